"""The bubblewrap backend against the sandbox contract (tests/support/sandboxes.py), with a real gateway,
plus what only bubblewrap has: the host's network shared on request, its host directories swept."""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

import pytest

from pipeline.harness.backends.bubblewrap import BubblewrapBackend
from pipeline.harness.sandbox import SandboxSpec
from tests.support.sandboxes import PROBE, BackendAt, SandboxContract, SpecFor, host_listener, started

pytestmark = pytest.mark.bubblewrap


@pytest.fixture(autouse=True)
def _bwrap_installed() -> None:
    if shutil.which("bwrap") is None:
        missing = "bwrap is missing: apt-get install bubblewrap (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)


@pytest.fixture
def backend_at() -> BackendAt:
    return BubblewrapBackend


@pytest.fixture
def backend(sandbox_root: Path) -> BubblewrapBackend:
    return BubblewrapBackend(sandbox_root)


@pytest.fixture
def spec_for() -> SpecFor:
    return SandboxSpec


class TestBubblewrap(SandboxContract):
    pass


async def test_allow_internet_shares_the_host_network(
    backend: BubblewrapBackend, tmp_path: Path, sandbox_gateway: str
) -> None:
    """The trade-off documented in docs/sandboxes.md: the host's own loopback services become reachable."""
    spec = SandboxSpec(workspace=tmp_path, gateway=sandbox_gateway, owner="internet", allow_internet=True)
    async with host_listener() as port, started(backend, spec) as sandbox:
        assert sandbox.gateway_url == f"http://{sandbox_gateway}"
        result = await sandbox.exec(
            ["python3", "-c", PROBE, sandbox.gateway_url, f"127.0.0.1:{port}"], env={}, limit_s=120
        )
    assert result.exit_code == 0, result.output
    assert f"reached 127.0.0.1:{port}" in result.output


async def test_the_sandbox_directory_is_gone_after_stop(
    backend: BubblewrapBackend, sandbox_root: Path, tmp_path: Path, sandbox_gateway: str
) -> None:
    sandbox = await backend.start(SandboxSpec(workspace=tmp_path, gateway=sandbox_gateway, owner="gone"))
    assert backend.etc is not None
    made = [name for name in os.listdir(sandbox_root) if name != backend.etc.name]
    assert len(made) == 1
    assert "owner.json" in os.listdir(sandbox_root / made[0])
    await sandbox.exec(["sh", "-c", "mkdir -p /tmp/deep/er && chmod 500 /tmp/deep"], env={}, limit_s=120)
    await sandbox.stop()
    assert os.listdir(sandbox_root) == [backend.etc.name], "only the /etc every sandbox shares is left"
    assert os.listdir(tmp_path) == []  # the workspace is the harness's, not the sandbox's


async def test_the_python_forwarder_serves_the_gateway_where_socat_is_missing(
    sandbox_root: Path, tmp_path: Path, sandbox_gateway: str
) -> None:
    """The contract above runs with socat inside where it is installed; this is the fallback's check."""
    backend = BubblewrapBackend(sandbox_root, socat=False)
    async with (
        host_listener() as port,
        started(backend, SandboxSpec(tmp_path, sandbox_gateway, "python")) as sandbox,
    ):
        result = await sandbox.exec(
            ["python3", "-c", PROBE, sandbox.gateway_url, f"127.0.0.1:{port}"],
            env={"ONLY": "this"},
            limit_s=120,
        )
        listed = await sandbox.exec(["env"], env={"ONLY": "this"}, limit_s=120)
    assert result.exit_code == 0, result.output
    assert "gateway 200" in result.output
    assert f"unreachable 127.0.0.1:{port}" in result.output
    assert sorted(listed.output.split()) == [
        "HOME=/home/sandbox",
        "ONLY=this",
        "PATH=/usr/local/bin:/usr/bin:/bin",
    ]


async def test_etc_holds_the_hosts_entries_programs_need_and_no_private_keys(
    backend: BubblewrapBackend, tmp_path: Path, sandbox_gateway: str
) -> None:
    """One bind of copies (``sandbox_etc``), not one per entry: the users, the TLS roots, the library
    cache are there; /etc/ssl/private and the rest of the host's /etc are not."""
    script = (
        "id -un; test -s /etc/ssl/certs/ca-certificates.crt && echo roots; test -e /etc/ld.so.cache && echo "
        "cache; ls /etc/ssl/private /etc/shadow 2>&1 | grep -c 'No such file'"
    )
    async with started(backend, SandboxSpec(tmp_path, sandbox_gateway, "etc")) as sandbox:
        result = await sandbox.exec(["sh", "-c", script], env={}, limit_s=120)
    assert result.output.split() == [pwd.getpwuid(os.getuid()).pw_name, "roots", "cache", "2"], result.output
