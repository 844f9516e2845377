"""Sandboxes as Kubernetes Jobs, through the official ``kubernetes`` client (the ``kubernetes`` extra).

One Job per sandbox (one pod, never restarted, ``sleep infinity`` in the task's image), labelled
``turnstile.owner=<owner>`` and annotated with the harness's host, pid and that process's start time for
``sweep``. Commands run through the API's exec; files travel as tar over exec (the image needs ``tar``,
``sh`` and ``kill``). The workspace is copied in at start: there is no shared disk, so results come back
with ``copy_out``. ``spec.mounts`` become read-only ``hostPath`` volumes (the pre-built agent CLIs must be on
every node, or baked into the image).

Network: the cluster's, narrowed by the NetworkPolicies in ``deploy/kubernetes/`` (egress only to the
gateway's pods and DNS, unless the pod is labelled ``turnstile.network=internet``); ``spec.gateway`` is the
gateway's in-cluster ``host:port`` (its Service). Time limit: past it, ``kill -9 -1`` inside ends every
process but the pod's init. Memory and CPUs: the container's limits.

The client is blocking: each call runs in a worker thread (``asyncio.to_thread``).

What was verified and what not (no API server could be had on the team's machines): docs/sandboxes.md.
"""

from __future__ import annotations

import asyncio
import io
import posixpath
import re
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import stream

from pipeline.harness.backends import hostdirs
from pipeline.harness.backends.commands import OutputTail
from pipeline.harness.sandbox import ExecResult, SandboxError, SandboxSpec

WORKDIR = "/workspace"
NAMESPACE = "turnstile-sandboxes"
CONTAINER = "sandbox"
LABEL_OWNER = "turnstile.owner"
LABEL_NETWORK = "turnstile.network"
APP = {"app.kubernetes.io/name": "turnstile-sandbox"}
LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
MAX_LIFE_S = 24 * 3600
"""activeDeadlineSeconds: a Job no sweep ever finds (its harness's host is gone) still ends."""


def job_manifest(spec: SandboxSpec, name: str, owner: hostdirs.Owner, host: str) -> client.V1Job:
    """The Job for one sandbox: the pure part of ``start``, checked against the client's models in tests."""
    if not LABEL_VALUE.match(spec.owner):
        raise SandboxError(f"kubernetes: owner {spec.owner!r} is not a label value (63 letters, digits, -_.)")
    if spec.image is None:
        raise SandboxError(
            "kubernetes: the task needs an image: build its environment/Dockerfile and push it to a "
            "registry the cluster pulls from, then give it as the task's image"
        )
    labels = {**APP, LABEL_OWNER: spec.owner, LABEL_NETWORK: "internet" if spec.allow_internet else "gateway"}
    limits = {}
    if spec.memory_mib is not None:
        limits["memory"] = f"{spec.memory_mib}Mi"
    if spec.cpus is not None:
        limits["cpu"] = str(spec.cpus)
    mounts = [client.V1VolumeMount(name="workspace", mount_path=WORKDIR)]
    volumes = [client.V1Volume(name="workspace", empty_dir=client.V1EmptyDirVolumeSource())]
    for index, (source, target) in enumerate(spec.mounts.items()):
        mounts.append(client.V1VolumeMount(name=f"mount-{index}", mount_path=target, read_only=True))
        volumes.append(
            client.V1Volume(name=f"mount-{index}", host_path=client.V1HostPathVolumeSource(path=str(source)))
        )
    container = client.V1Container(
        name=CONTAINER,
        image=spec.image,
        command=["sleep", "infinity"],
        working_dir=WORKDIR,
        volume_mounts=mounts,
        resources=client.V1ResourceRequirements(limits=limits or None, requests=limits or None),
        security_context=client.V1SecurityContext(allow_privilege_escalation=False),
    )
    pod = client.V1PodSpec(
        containers=[container],
        volumes=volumes,
        restart_policy="Never",
        automount_service_account_token=False,  # nothing inside may talk to the API server
        enable_service_links=False,  # no other Service's address in the environment
        termination_grace_period_seconds=0,
    )
    annotations = {"turnstile.harness.host": host, "turnstile.harness.pid": str(owner.pid),
                   "turnstile.harness.start": str(owner.start_time)}  # fmt: skip
    return client.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=client.V1ObjectMeta(name=name, labels=labels, annotations=annotations),
        spec=client.V1JobSpec(
            backoff_limit=0,
            active_deadline_seconds=MAX_LIFE_S,
            ttl_seconds_after_finished=60,
            template=client.V1PodTemplateSpec(metadata=client.V1ObjectMeta(labels=labels), spec=pod),
        ),
    )


def exec_command(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> list[str]:
    """``argv`` in ``cwd`` with exactly ``env`` (the API's exec has no environment of its own to give)."""
    return [
        "sh",
        "-c",
        'cd "$0" && exec "$@"',
        cwd,
        "env",
        "-i",
        *[f"{k}={v}" for k, v in env.items()],
        *argv,
    ]


class KubernetesSandbox:
    """One Job's pod; every call goes through the API server."""

    def __init__(
        self, spec: SandboxSpec, core: client.CoreV1Api, batch: client.BatchV1Api, name: str, pod: str
    ):
        self.spec, self.core, self.batch, self.name, self.pod = spec, core, batch, name, pod
        self.stopped = False

    @property
    def gateway_url(self) -> str:
        return f"http://{self.spec.gateway}"

    @property
    def workdir(self) -> str:
        return WORKDIR

    def _open(self, command: list[str], *, stdin: bool = False) -> Any:
        return stream(
            self.core.connect_get_namespaced_pod_exec, self.pod, NAMESPACE, container=CONTAINER,
            command=command, stdin=stdin, stdout=True, stderr=True, tty=False,
            _preload_content=False, binary=True,
        )  # fmt: skip

    def _run(
        self, command: list[str], limit_s: float, stdin: bytes | None = None
    ) -> tuple[int | None, bytes, str]:
        """Exit code (None: past ``limit_s``, every process killed), stdout, stderr."""
        started = time.monotonic()
        response = self._open(command, stdin=stdin is not None)
        if stdin is not None:
            response.write_stdin(stdin)  # a tar ends with its own end blocks: tar stops without an EOF
        out, err = io.BytesIO(), OutputTail()
        while response.is_open():
            response.update(timeout=1)
            out.write(response.read_stdout() or b"")
            err.add(response.read_stderr() or b"")
            if time.monotonic() - started > limit_s:
                response.close()
                self._run(["sh", "-c", "kill -9 -1"], 60)  # all but the pod's init and this shell
                return None, out.getvalue(), err.text()
        return response.returncode, out.getvalue(), err.text()

    async def exec(
        self, argv: Sequence[str], *, env: Mapping[str, str], limit_s: float, cwd: str | None = None
    ) -> ExecResult:
        if self.stopped:
            raise SandboxError("kubernetes: exec on a stopped sandbox")
        started = time.monotonic()
        code, out, err = await asyncio.to_thread(self._run, exec_command(argv, env, cwd or WORKDIR), limit_s)
        output = out.decode(errors="replace") + err
        return ExecResult(exit_code=code, output=output, seconds=time.monotonic() - started)

    async def copy_in(self, source: Path, target: str) -> None:
        inside = posixpath.normpath(posixpath.join(WORKDIR, target))
        data = await asyncio.to_thread(hostdirs.tar_as, source, inside)
        code, _, err = await asyncio.to_thread(self._run, ["tar", "xf", "-", "-C", "/"], 600, data)
        if code != 0:
            raise SandboxError(f"kubernetes: copying {source} in failed: {err.strip()}")

    async def copy_out(self, source: str, target: Path) -> None:
        inside = posixpath.normpath(posixpath.join(WORKDIR, source))
        parent, name = posixpath.split(inside)
        code, data, err = await asyncio.to_thread(self._run, ["tar", "cf", "-", "-C", parent, name], 600)
        if code != 0:
            if "No such file" in err:
                raise FileNotFoundError(f"{source} does not exist inside the sandbox")
            raise SandboxError(f"kubernetes: copying {source} out failed: {err.strip()}")
        await asyncio.to_thread(hostdirs.extract_as, data, target)

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        await asyncio.to_thread(delete_job, self.batch, self.name)


def delete_job(batch: client.BatchV1Api, name: str) -> None:
    try:
        batch.delete_namespaced_job(name, NAMESPACE, propagation_policy="Background", grace_period_seconds=0)
    except ApiException as error:
        if error.status != 404:
            raise SandboxError(f"kubernetes: deleting Job {name} failed: {error.reason}") from error


class KubernetesBackend:
    """Jobs in the ``turnstile-sandboxes`` namespace (deploy/kubernetes/), with the client's configuration
    (in-cluster, else ~/.kube/config) unless given an ``ApiClient``."""

    name = "kubernetes"

    def __init__(self, api: client.ApiClient | None = None, ready_s: float = 300) -> None:
        if api is None:
            config.load_config()  # type: ignore[no-untyped-call]  # the client leaves it unannotated
            api = client.ApiClient()
        self.core, self.batch, self.ready_s = client.CoreV1Api(api), client.BatchV1Api(api), ready_s
        self.host = socket.gethostname()

    async def start(self, spec: SandboxSpec) -> KubernetesSandbox:
        name = f"sandbox-{uuid.uuid4().hex[:12]}"
        job = job_manifest(spec, name, hostdirs.Owner.current(spec.owner), self.host)
        try:
            await asyncio.to_thread(self.batch.create_namespaced_job, NAMESPACE, job)
        except ApiException as error:
            raise SandboxError(
                f"kubernetes: creating Job {name} failed: {error.reason}: {error.body}"
            ) from error
        try:
            pod = await asyncio.to_thread(self._running_pod, name)
            sandbox = KubernetesSandbox(spec, self.core, self.batch, name, pod)
            await sandbox.copy_in(spec.workspace, WORKDIR)
        except BaseException:
            await asyncio.to_thread(delete_job, self.batch, name)
            raise
        return sandbox

    def _running_pod(self, job: str) -> str:
        """The Job's pod once it runs; a pod that cannot (image not pulled, failed) is a ``SandboxError``."""
        deadline = time.monotonic() + self.ready_s
        while time.monotonic() < deadline:
            for pod in self.core.list_namespaced_pod(NAMESPACE, label_selector=f"job-name={job}").items:
                if pod.metadata is not None and pod.status is not None:
                    if reason := _cannot_run(pod.status):
                        raise SandboxError(f"kubernetes: the pod of Job {job} cannot run: {reason}")
                    if pod.status.phase == "Running":
                        return str(pod.metadata.name)
            time.sleep(0.5)
        raise SandboxError(f"kubernetes: the pod of Job {job} was not running after {self.ready_s} s")

    async def sweep(self, owner: str) -> int:
        """Delete ``owner``'s Jobs whose harness ran on this host and is gone (another host's harness sweeps
        its own; ``activeDeadlineSeconds`` ends a Job whose host never comes back)."""
        selector = f"{LABEL_OWNER}={owner}"
        jobs = await asyncio.to_thread(self.batch.list_namespaced_job, NAMESPACE, label_selector=selector)
        removed = 0
        for job in jobs.items:
            if job.metadata is not None and job.metadata.name and not _harness_alive(job.metadata, self.host):
                await asyncio.to_thread(delete_job, self.batch, job.metadata.name)
                removed += 1
        return removed


def _cannot_run(status: client.V1PodStatus) -> str | None:
    """Why a pod will never run (failed, its image not pulled), or None while it may still."""
    if status.phase == "Failed":
        return f"failed: {status.message}"
    for container in status.container_statuses or []:
        waiting = container.state.waiting if container.state else None
        if waiting and waiting.reason in {"ErrImagePull", "ImagePullBackOff", "InvalidImageName"}:
            return f"{waiting.reason}: {waiting.message}"
    return None


def _harness_alive(metadata: client.V1ObjectMeta, host: str) -> bool:
    """Whether the Job's harness may still run: on another host (not ours to judge), or alive here."""
    notes = metadata.annotations or {}
    if notes.get("turnstile.harness.host") != host:
        return True
    start = notes.get("turnstile.harness.start", "None")
    pid = int(notes.get("turnstile.harness.pid", "0"))
    return hostdirs.Owner("", pid, None if start == "None" else int(start)).alive()
