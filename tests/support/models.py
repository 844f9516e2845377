"""Local models for the tests, built in a temporary directory of their own (outside pytest's basetemp, for
the reason given in ``tests/conftest.py``'s ``servers``) and removed after. No hub: ``HF_HUB_OFFLINE``.
Imports nothing but the model builders, so ``tests/e2e/test_gpu.py`` can use it without the conftest."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def built_model(build: Callable[[Path], Path], name: str, prefix: str) -> Iterator[Path]:
    """``build(directory / name)`` in a fresh temporary directory named ``prefix...``; removed on exit."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield build(directory / name)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
