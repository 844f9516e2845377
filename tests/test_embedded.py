"""The embedded PostgreSQL as root: it runs as `nobody` without touching the host's users or directory modes,
even when the data directory and pgserver's binaries sit where that user cannot reach (root's home, 0700).
Not as root: the cluster is in the data directory and runs as this user."""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

import psycopg
import pytest

from pipeline.dev import embedded
from pipeline.dev.embedded import EmbeddedPostgres


def modes(path: Path) -> list[tuple[str, int]]:
    return [(str(p), p.stat().st_mode) for p in [path, *path.parents]]


def test_the_embedded_postgres_starts_where_its_user_cannot_reach_and_changes_no_mode(
    server_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = server_dir / "home"  # like /root: 0700, so no other user may enter
    home.mkdir(mode=0o700)
    data_dir = home / "project" / ".turnstile" / "postgres"
    install = home / "venv" / "site-packages" / "pgserver" / "pginstall"  # and its libraries beside it
    shutil.copytree(EmbeddedPostgres.bin_dir().parent, install, symlinks=True)
    libs = EmbeddedPostgres.bin_dir().parent.parent.parent / "pgserver.libs"
    shutil.copytree(libs, install.parent.parent / "pgserver.libs", symlinks=True)
    monkeypatch.setattr(EmbeddedPostgres, "bin_dir", staticmethod(lambda: install / "bin"))
    system_dir = server_dir / "var-lib-turnstile"
    monkeypatch.setattr(embedded, "SYSTEM_DIR", system_dir)
    users = Path("/etc/passwd").read_text()
    data_dir.mkdir(parents=True)
    before = modes(data_dir)

    postgres = EmbeddedPostgres(data_dir)
    postgres.start()
    try:
        with psycopg.connect(postgres.url) as connection:
            assert connection.execute("SELECT 1").fetchone() == (1,)
            pgdata = Path(str(connection.execute("SHOW data_directory").fetchone()[0]))  # type: ignore[index]
    finally:
        postgres.stop()

    assert modes(data_dir) == before  # no directory above the data was opened up
    assert Path("/etc/passwd").read_text() == users  # no user was added
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        assert pgdata.stat().st_uid == nobody.pw_uid
        assert pgdata.parent.parent == system_dir  # the cluster went where nobody can reach it...
        assert (data_dir / "pgdata.location").read_text().strip() == str(pgdata)  # ...named from the data dir
        assert not (data_dir / "pgdata").exists()
        copies = list(system_dir.glob("pginstall-*/pgserver/pginstall/bin/postgres"))
        assert len(copies) == 1  # and the binaries were copied there, once
    else:
        assert pgdata == data_dir / "pgdata"
        assert pgdata.stat().st_uid == os.geteuid()

    postgres.start()  # a restart finds the same cluster
    try:
        with psycopg.connect(postgres.url) as connection:
            assert Path(str(connection.execute("SHOW data_directory").fetchone()[0])) == pgdata  # type: ignore[index]
    finally:
        postgres.stop()
