"""An inference consumer in a process of its own (scripted backend), for tests that kill it.

python -m tests.support.consumer_process NATS_URL POLICY CONSUMER_ID DELAY_SECONDS
"""

from __future__ import annotations

import asyncio
import sys

from consumers.inference import InferenceConfig, create_app
from pipeline.inference.backends.scripted import ScriptedBackend


async def main(nats_url: str, policy: str, consumer_id: str, delay: float) -> None:
    config = InferenceConfig(
        nats_url, policy, backend="scripted", consumer_id=consumer_id, heartbeat_interval=0.2
    )
    app, _ = create_app(config, ScriptedBackend(delay=delay))
    await app.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
