"""The ``/etc`` a bubblewrap sandbox sees: the few host entries programs need, copied into one folder.

Binding each entry of the host's ``/etc`` on its own cost bwrap a mount and a read-only remount apiece, on
every command: thirteen of them took about as long as all the other binds together (docs/sandboxes.md,
"Start-up cost"). One folder holding copies is one bind. It is made once per content (its name is the
digest of what it holds, so a changed host file makes a new folder) under the backend's root, and shared
by every sandbox and harness there; ``/etc/ssl/private`` is left out.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

ENTRIES = (
    "hosts", "passwd", "group", "nsswitch.conf", "localtime", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
    "alternatives", "ssl", "ca-certificates", "ca-certificates.conf", "mime.types",
)  # fmt: skip
"""What of the host's /etc programs need (users, libraries, TLS roots)."""
PLACEHOLDERS = ("resolv.conf",)
"""Empty files: where a sandbox with the internet gets the host's own bound over it (bwrap cannot make a
mount point inside a read-only bind)."""
LEFT_OUT = shutil.ignore_patterns("private")


def _walk(host: Path) -> list[Path]:
    """Every path of the entries the folder copies, in a stable order (links not followed)."""
    found = []
    for name in ENTRIES:
        entry = host / name
        if not (entry.exists() or entry.is_symlink()):
            continue
        found.append(entry)
        if entry.is_dir() and not entry.is_symlink():
            found += sorted(p for p in entry.rglob("*") if "private" not in p.relative_to(entry).parts)
    return found


def _digest(host: Path) -> str:
    digest = hashlib.sha256()
    for path in _walk(host):
        digest.update(str(path.relative_to(host)).encode() + b"\0")
        if path.is_symlink():
            digest.update(b"-> " + os.fsencode(os.readlink(path)))
        elif path.is_file():
            digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def prepared_etc(root: Path, host: Path = Path("/etc")) -> Path:
    """The folder under ``root`` to bind as the sandbox's ``/etc``, made now if it is not there yet.

    Made in a temporary folder and renamed into place, so a harness starting beside another never binds a
    half-copied folder."""
    target = root / f"etc-{_digest(host)}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".etc-", dir=root))
    for name in ENTRIES:
        entry = host / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, staging / name, symlinks=True, ignore=LEFT_OUT)
        elif entry.exists() or entry.is_symlink():
            shutil.copy2(entry, staging / name, follow_symlinks=False)
    for name in PLACEHOLDERS:
        (staging / name).touch()
    staging.chmod(0o755)
    try:
        staging.rename(target)
    except OSError:  # another harness made it first
        with contextlib.suppress(OSError):
            shutil.rmtree(staging)
    return target
