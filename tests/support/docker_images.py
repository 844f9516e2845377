"""What the Docker sandbox tests run in, with Docker Hub out of reach: the backend's own empty image
(``turnstile-hostroot``: mount points and the host's /usr symlinks) with the host's system folders bound
read-only, so ``sh`` and ``python3`` inside are the host's."""

from __future__ import annotations

from pathlib import Path

from pipeline.harness.backends import hostroot


def host_mounts() -> dict[Path, str]:
    """The host's real system folders (``/usr``; ``/lib`` where it is not a symlink) at the same paths."""
    return {Path(path): path for path, target in hostroot.system_layout() if not target}
