"""Task-queue workers (a runner's, a harness's) whose notes of progress never reach the server."""

from __future__ import annotations

import asyncio

from pipeline.runners import RunningTasks


class SilentTasks(RunningTasks):
    """Running tasks whose notes of progress never reach the server, as in an outage longer than ack_wait:
    each task is delivered again every ``ack_wait`` while it runs."""

    instances: list[SilentTasks] = []

    def __init__(self, ack_wait: float) -> None:
        super().__init__(ack_wait)
        SilentTasks.instances.append(self)

    async def _keep_alive(self, key: str) -> None:
        await asyncio.Event().wait()
