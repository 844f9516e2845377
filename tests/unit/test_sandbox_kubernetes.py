"""The Kubernetes backend without a cluster (none could be had on the team's machines): the Job it builds and
the manifests in deploy/kubernetes/, checked against the official client's models, and against each other
(the NetworkPolicies select the pods the backend labels; the Role allows the calls the backend makes).
What this leaves unverified is written in docs/sandboxes.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from pipeline.harness.backends import hostdirs
from pipeline.harness.backends.kubernetes import NAMESPACE, exec_command, job_manifest
from pipeline.harness.sandbox import SandboxError, SandboxSpec

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
API = client.ApiClient()


def manifests() -> list[dict[str, Any]]:
    return [
        doc for path in sorted(DEPLOY.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc
    ]


def as_model(doc: dict[str, Any]) -> Any:
    """The manifest read by the client's own deserializer into the model of its kind."""
    return API.deserialize(json.dumps(doc), f"V1{doc['kind']}", "application/json")


def job(**spec: Any) -> dict[str, Any]:
    defaults: dict[str, Any] = {"workspace": Path("/w"), "gateway": "gw.turnstile.svc:8000", "owner": "run-1"}
    made = job_manifest(
        SandboxSpec(**{**defaults, **spec}), "sandbox-x", hostdirs.Owner("run-1", 42, 7), "host-a"
    )
    serialized: dict[str, Any] = API.sanitize_for_serialization(made)
    return serialized


@pytest.mark.parametrize("doc", manifests(), ids=lambda doc: f"{doc['kind']}/{doc['metadata']['name']}")
def test_every_manifest_is_a_valid_object_of_its_kind(doc: dict[str, Any]) -> None:
    """Read into the client's model and written back unchanged: a misspelt or misplaced field is dropped by
    the model, so the round trip differs."""
    assert API.sanitize_for_serialization(as_model(doc)) == doc


def test_the_job_runs_one_pod_once_with_the_sandboxes_limits_and_labels() -> None:
    made = job(image="task:1", memory_mib=2048, cpus=1.5, mounts={Path("/opt/clis"): "/opt/clis"})
    assert made["metadata"]["labels"]["turnstile.owner"] == "run-1"
    assert made["metadata"]["annotations"] == {
        "turnstile.harness.host": "host-a", "turnstile.harness.pid": "42", "turnstile.harness.start": "7",
    }  # fmt: skip
    assert made["spec"]["backoffLimit"] == 0
    pod = made["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["image"] == "task:1"
    assert container["resources"]["limits"] == {"memory": "2048Mi", "cpu": "1.5"}
    assert {"name": "mount-0", "mountPath": "/opt/clis", "readOnly": True} in container["volumeMounts"]
    assert {"name": "mount-0", "hostPath": {"path": "/opt/clis"}} in pod["volumes"]
    assert as_model(made) is not None


def test_the_network_policies_select_the_backends_pods() -> None:
    """Every sandbox pod is denied all but the gateway; only an allow_internet pod gets the open policy."""
    policies = {doc["metadata"]["name"]: doc for doc in manifests() if doc["kind"] == "NetworkPolicy"}
    assert {doc["metadata"]["namespace"] for doc in policies.values()} == {NAMESPACE}

    def selected(labels: dict[str, str]) -> set[str]:
        return {
            name for name, doc in policies.items()
            if doc["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        }  # fmt: skip

    closed = job(image="task:1")["spec"]["template"]["metadata"]["labels"]
    open_ = job(image="task:1", allow_internet=True)["spec"]["template"]["metadata"]["labels"]
    assert selected(closed) == {"sandboxes-deny-all", "sandboxes-to-gateway"}
    assert selected(open_) == {"sandboxes-deny-all", "sandboxes-to-gateway", "sandboxes-with-internet"}


def test_the_role_allows_exactly_the_calls_the_backend_makes() -> None:
    (role,) = [doc for doc in manifests() if doc["kind"] == "Role"]
    assert role["metadata"]["namespace"] == NAMESPACE
    allowed = {
        (resource, verb) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]
    }
    needed = {
        ("jobs", "create"),
        ("jobs", "list"),
        ("jobs", "delete"),
        ("pods", "list"),
        ("pods/exec", "create"),
    }
    assert needed <= allowed
    assert not any(resource in {"secrets", "configmaps"} for resource, _ in allowed)


def test_a_job_needs_an_image_and_an_owner_that_is_a_label_value() -> None:
    with pytest.raises(SandboxError, match="needs an image"):
        job()
    with pytest.raises(SandboxError, match="not a label value"):
        job(image="task:1", owner="has spaces")


def test_a_command_gets_exactly_its_environment_in_its_directory() -> None:
    command = exec_command(["pytest", "-q"], {"A": "1"}, "/workspace/sub")
    assert command == [
        "sh",
        "-c",
        'cd "$0" && exec "$@"',
        "/workspace/sub",
        "env",
        "-i",
        "A=1",
        "pytest",
        "-q",
    ]
