"""The Docker backend against the sandbox contract (tests/support/sandboxes.py), with a real gateway, on a
real engine (Debian's docker.io; .ci/run starts dockerd where it can), plus an image built from a task's
environment/Dockerfile."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipeline.harness.backends.docker import HOSTROOT_IMAGE, DockerBackend, hostroot_image
from pipeline.harness.backends.hostroot import real_folders as host_mounts
from pipeline.harness.sandbox import SandboxBackend, SandboxSpec
from tests.support.sandboxes import BackendAt, SandboxContract, SpecFor, started

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module", autouse=True)
def _engine() -> None:
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"no Docker engine answers ({error}): apt-get install docker.io and start dockerd")
    if info.returncode != 0:
        pytest.skip(f"no Docker engine answers: {info.stderr.strip()[:300]}")


@pytest.fixture
async def backend_at() -> BackendAt:
    await hostroot_image()
    return DockerBackend


@pytest.fixture
def backend(backend_at: BackendAt, sandbox_root: Path) -> SandboxBackend:
    return backend_at(sandbox_root)


@pytest.fixture
def spec_for() -> SpecFor:
    def spec(workspace: Path, gateway: str, owner: str, mounts: dict[Path, str] | None = None) -> SandboxSpec:
        every = {**host_mounts(), **(mounts or {})}
        return SandboxSpec(
            workspace=workspace, gateway=gateway, owner=owner, image=HOSTROOT_IMAGE, mounts=every
        )

    return spec


class TestDocker(SandboxContract):
    pass


async def test_the_image_is_built_from_the_tasks_dockerfile(
    backend: SandboxBackend, tmp_path: Path, sandbox_gateway: str
) -> None:
    environment, workspace = tmp_path / "environment", tmp_path / "workspace"
    environment.mkdir()
    workspace.mkdir()
    (environment / "hello.txt").write_text("built from the task's Dockerfile\n")
    (environment / "Dockerfile").write_text(f"FROM {HOSTROOT_IMAGE}\nCOPY hello.txt /opt/task/hello.txt\n")
    spec = SandboxSpec(
        workspace=workspace,
        gateway=sandbox_gateway,
        owner="build",
        environment=environment,
        mounts=host_mounts(),
    )
    async with started(backend, spec) as sandbox:
        result = await sandbox.exec(["cat", "/opt/task/hello.txt"], env={}, limit_s=120)
    assert result.output == "built from the task's Dockerfile\n"


async def test_memory_and_cpus_are_the_containers_limits(
    backend: SandboxBackend, tmp_path: Path, sandbox_gateway: str
) -> None:
    spec = SandboxSpec(
        workspace=tmp_path, gateway=sandbox_gateway, owner="limits", image=HOSTROOT_IMAGE,
        mounts=host_mounts(), memory_mib=256, cpus=0.5,
    )  # fmt: skip
    async with started(backend, spec) as sandbox:
        memory = (
            "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes"
        )
        cpu = "cut -d' ' -f1 /sys/fs/cgroup/cpu.max 2>/dev/null || cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us"
        result = await sandbox.exec(["sh", "-c", f"{memory}; {cpu}"], env={}, limit_s=120)
    memory_bytes, quota_us = result.output.split()  # cgroup v2 or v1: the CPU quota per 100 ms period
    assert int(memory_bytes) == 256 * 1024 * 1024, result.output
    assert int(quota_us) == 50_000, result.output
