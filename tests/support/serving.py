"""An inference consumer running inside the test's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from consumers.inference import InferenceConfig, create_app
from pipeline.inference.backends import Backend
from pipeline.inference.service import InferenceService


@asynccontextmanager
async def serving(config: InferenceConfig, backend: Backend | None = None) -> AsyncIterator[InferenceService]:
    """Start the consumer app for ``config`` (on ``backend``, or the one the config names); stop it after."""
    app, service = create_app(config, backend)
    await app.start()
    try:
        yield service
    finally:
        await app.stop()
