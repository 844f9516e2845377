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
from pipeline.dev.embedded import EmbeddedPostgres, outside_clusters, prune_outside_clusters


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


def _start_and_mark(postgres: EmbeddedPostgres, table: str | None) -> bool:
    """Start, say whether ``table`` (made by an earlier start) is there, make it if named, stop."""
    postgres.start()
    try:
        with psycopg.connect(postgres.url, autocommit=True) as connection:
            row = connection.execute("SELECT to_regclass('public.marker') IS NOT NULL").fetchone()
            if table is not None:
                connection.execute(f"CREATE TABLE {table} (x int)")
            return bool(row and row[0])
    finally:
        postgres.stop()


def test_a_data_directory_made_again_at_the_same_path_starts_fresh_and_the_old_cluster_can_be_pruned(
    server_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system_dir = server_dir / "var-lib-turnstile"
    monkeypatch.setattr(embedded, "SYSTEM_DIR", system_dir)
    home = server_dir / "home"  # 0700: as root, the cluster goes under SYSTEM_DIR
    home.mkdir(mode=0o700)
    data_dir = home / "clone" / ".turnstile" / "postgres"
    data_dir.mkdir(parents=True)
    postgres = EmbeddedPostgres(data_dir)
    assert not _start_and_mark(postgres, "marker")
    assert _start_and_mark(postgres, None)  # a restart keeps the cluster
    first = outside_clusters(system_dir)

    shutil.rmtree(home / "clone")  # the clone removed, and cloned again at the same path
    data_dir.mkdir(parents=True)
    assert not _start_and_mark(postgres, None)  # a fresh database, not the removed clone's

    if os.geteuid() != 0:
        assert first == []  # the cluster lives in the data directory
        assert outside_clusters(system_dir) == []
    else:
        assert [(c.owner, c.orphaned, c.running) for c in first] == [(data_dir, False, False)]
        clusters = {c.path: c for c in outside_clusters(system_dir)}
        assert len(clusters) == 2
        assert clusters[first[0].path].orphaned  # its data directory names another cluster now
        (current,) = [c for c in clusters.values() if not c.orphaned]
        assert (data_dir / "pgdata.location").read_text().strip() == str(current.path / "pgdata")
        assert (current.path / "owner").read_text().strip() == str(data_dir)

        copy = home / "copy"  # a copy of a data directory that still exists does not share its cluster
        shutil.copytree(data_dir, copy)
        with pytest.raises(embedded.EmbeddedServerError, match="is a copy of"):
            EmbeddedPostgres(copy).start()

        assert [c.path for c in prune_outside_clusters(system_dir)] == [first[0].path]
        assert [c.path for c in outside_clusters(system_dir)] == [current.path]
        assert _start_and_mark(postgres, None) is False  # pruning left the live cluster alone

    postgres.remove()
    assert outside_clusters(system_dir) == []
    assert not (data_dir / "pgdata").exists()
    assert not (data_dir / "pgdata.location").exists()


def test_up_reset_removes_the_data_directory_s_database_and_state_and_refuses_while_it_runs(
    server_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from consumers.cli import app
    from pipeline.dev.embedded import EmbeddedServers

    system_dir = server_dir / "var-lib-turnstile"
    monkeypatch.setattr(embedded, "SYSTEM_DIR", system_dir)
    home = server_dir / "home"
    home.mkdir(mode=0o700)
    data_dir = home / ".turnstile"
    (data_dir / "models").mkdir(parents=True)
    (data_dir / "checkpoints" / "v000145").mkdir(parents=True)
    servers = EmbeddedServers(data_dir)
    with servers:
        with psycopg.connect(servers.postgres.url, autocommit=True) as connection:
            connection.execute("CREATE TABLE marker (x int)")
        with pytest.raises(embedded.EmbeddedServerError, match="still runs"):
            EmbeddedServers(data_dir).reset()  # another process's view of a running server: refused
    assert len(outside_clusters(system_dir)) == (1 if os.geteuid() == 0 else 0)

    listed = CliRunner().invoke(app, ["up", "--list-clusters"])
    assert listed.exit_code == 0, listed.output
    assert ("in use" in listed.output) == (os.geteuid() == 0)

    EmbeddedServers(data_dir).reset()
    assert sorted(p.name for p in data_dir.iterdir()) == ["models"]  # what the database named is gone
    assert outside_clusters(system_dir) == []
    assert not _start_and_mark(EmbeddedPostgres(data_dir / "postgres"), None)  # the next start is fresh
    EmbeddedPostgres(data_dir / "postgres").remove()

    pruned = CliRunner().invoke(app, ["up", "--prune"])
    assert pruned.exit_code == 0, pruned.output
    assert "no clusters kept" in pruned.output
