"""A harness stand-in for the sweep test: starts two sandboxes, runs a long command in each, prints
``ready <marker>`` and waits to be killed (-9), leaving the sandboxes behind.

``python -m tests.support.sandbox_child BACKEND ROOT OWNER WORKSPACE GATEWAY`` (ROOT: the backend's
folder for sandbox directories, the same as the test's backend, so that its sweep finds them)
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

from pipeline.harness.sandbox import SandboxBackend, SandboxSpec


def backend_and_spec(
    name: str, root: str, owner: str, workspace: Path, gateway: str
) -> tuple[SandboxBackend, SandboxSpec]:
    if name == "bubblewrap":
        from pipeline.harness.backends.bubblewrap import BubblewrapBackend

        return BubblewrapBackend(Path(root)), SandboxSpec(workspace=workspace, gateway=gateway, owner=owner)
    from pipeline.harness.backends.docker import HOSTROOT_IMAGE, DockerBackend
    from pipeline.harness.backends.hostroot import real_folders

    image, mounts = HOSTROOT_IMAGE, real_folders()
    return DockerBackend(Path(root)), SandboxSpec(
        workspace=workspace, gateway=gateway, owner=owner, image=image, mounts=mounts
    )


async def main(name: str, root: str, owner: str, workspace: str, gateway: str) -> None:
    backend, spec = backend_and_spec(name, root, owner, Path(workspace), gateway)
    marker = f"{5000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 1000}"
    sandboxes = [await backend.start(spec) for _ in range(2)]
    commands = [asyncio.create_task(s.exec(["sleep", marker], env={}, limit_s=3600)) for s in sandboxes]
    await asyncio.sleep(0)  # let the commands start before the parent is told
    print("ready", marker, flush=True)
    await asyncio.gather(*commands)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
