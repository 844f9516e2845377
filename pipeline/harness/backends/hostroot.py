"""The host's system folders as a sandbox sees them: read-only binds, or the same symlinks where ``/usr`` is
merged (Debian 12: ``/bin -> usr/bin``). bubblewrap binds them for every sandbox; Docker binds them into
the small image its network forwarder runs in, so the forwarder can run on the host's Python."""

from __future__ import annotations

import os
import sys
from pathlib import Path

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def system_layout() -> list[tuple[str, str | None]]:
    """``(path, symlink target)`` for each system folder the host has; target None: a real folder to bind.
    A Python outside these (pyenv, conda) is added as a folder: the forwarder runs on it."""
    layout: list[tuple[str, str | None]] = []
    for path in SYSTEM:
        if os.path.islink(path):
            layout.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            layout.append((path, None))
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == p or prefix.startswith(p + "/") for p in SYSTEM):
        layout.append((prefix, None))
    return layout


def real_folders() -> dict[Path, str]:
    """The system folders that are folders, not symlinks, each at its own path: the mounts that make the
    host's programs run in an otherwise empty image (Docker's ``turnstile-hostroot``)."""
    return {Path(path): path for path, target in system_layout() if not target}


def interpreter() -> str:
    """The host's own Python (not a virtualenv's wrapper, whose site-packages a sandbox does not see)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))
