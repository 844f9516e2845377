"""Attacks with each role's own credentials, on the real servers: NATS on deploy/nats.conf (its users and
permissions) and PostgreSQL logins that are members of the group roles (as deploy/postgres-init.sql makes).

Every probe that must be refused prints ``refused: <probe>`` when it is (``pytest -s`` shows them) and fails
the test otherwise. The probes: the ones an attacker tried first (reply subjects that point at streams,
reading other roles' inboxes, consumers on other streams, rows forged into ``events``, a read-only role
holding the append lock), and the ones an attacker would try next (JetStream API calls outside a role's
streams, the object store, KV buckets, ``$SYS``, switching roles in PostgreSQL).
"""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import psycopg
import pytest

from consumers.harness import harness_tasks
from consumers.inference import InferenceConfig
from pipeline.batches.format import BatchSample, TrainingBatch, encode_batch
from pipeline.batches.relay import BATCHES_STREAM, batch_subject, ensure_batches_stream
from pipeline.errors import StoreUnavailable
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from pipeline.log.store import APPEND_LOCK
from pipeline.runners import TaskSpec, submit_tasks
from pipeline.runners.taskqueue import (
    HARNESS_TASKS_STREAM,
    TASKS_STREAM,
    ensure_tasks_stream,
    harness_durable,
    runner_durable,
    task_stream,
    task_subject,
)
from pipeline.settings import jetstream, jetstream_api_prefix, libpq_url
from pipeline.sql import SqlError, run_readonly
from pipeline.training import BatchSubscription, TrainerBacklog
from pipeline.training.subscription import publish_policy_version
from pipeline.versions import versions_subject
from schemas import ChatMessage, LLMRequest, PolicyVersionPublished
from tests.conftest import login_url
from tests.e2e.test_deploy import new_policy
from tests.integration.test_cli import TURNSTILE, clean_env
from tests.support.backends import RuleBackend, echo_rule
from tests.support.factories import finished, new_stream, opened, reward, started_in, turn
from tests.support.roles import Connected, RoleNats
from tests.support.serving import serving
from tests.support.waiting import wait_until

Connect = Callable[[str], Awaitable[Connected]]


def refused(probe: str) -> None:
    print(f"refused: {probe}")


def api(role: str, subject: str) -> str:
    """``subject`` of the JetStream API as ``role`` reaches it: through its account's import, under its own
    prefix (deploy/nats.conf; nats-py sends there with ``jetstream(connection)``)."""
    return subject.replace("$JS.API", jetstream_api_prefix(f"_INBOX_{role}"), 1)


async def stored(admin: Connected, stream: str, subject: str) -> int:
    """How many messages ``stream`` holds on ``subject``."""
    info = await jetstream(admin.nc).stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


# -- NATS --------------------------------------------------------------------------------------------------


async def test_a_reply_subject_naming_a_stream_cannot_make_inference_publish_there(
    connect: Connect, role_nats: RoleNats
) -> None:
    policy = new_policy()
    admin, runner = await connect("admin"), await connect("runner")
    await ensure_batches_stream(admin.nc)
    await ensure_tasks_stream(admin.nc)
    config = InferenceConfig(role_nats.url("inference"), policy, backend="scripted", consumer_id="c1")
    targets = (
        (BATCHES_STREAM, batch_subject(policy)),
        (TASKS_STREAM, task_subject(policy)),
        (None, versions_subject(policy)),
    )
    async with serving(config, RuleBackend(echo_rule)) as service:
        versions = await admin.nc.subscribe(versions_subject(policy))
        await admin.nc.flush()  # subscribed before the requests: else "nothing arrived" would prove nothing
        for _, subject in targets:
            # garbage (answered with an LLMError) and a valid request (answered with a reply)
            await runner.nc.publish(f"llm.{policy}.requests", b"garbage", reply=subject)
            request = LLMRequest(policy=policy, messages=[ChatMessage(role="user", content="hi")])
            await runner.nc.publish(
                f"llm.{policy}.requests", request.model_dump_json().encode(), reply=subject
            )
        await runner.nc.flush()
        await wait_until(lambda: service.requests_served >= 3, 60, "the consumer to answer the requests")
        # the consumer stays up and answers a request made the normal way
        llm = await NatsLLMClient.connect(role_nats.url("runner"), wait_for_consumer=10.0)
        try:
            answer = await llm(LLMRequest(policy=policy, messages=[ChatMessage(role="user", content="ok")]))
        finally:
            await llm.close()
        assert answer.consumer_id == "c1"
        await admin.nc.flush()
        with pytest.raises(nats.errors.TimeoutError):
            await versions.next_msg(timeout=0.5)  # nothing arrived on policy.<policy>.versions
    for stream, subject in targets:
        if stream is not None:
            assert await stored(admin, stream, subject) == 0
        refused(f"inference publishing a reply on {subject}")


@pytest.mark.parametrize(
    ("role", "subject"),
    [
        ("runner", "_INBOX.>"),
        ("runner", "_INBOX_gateway.>"),
        ("runner", "_INBOX_trainer.>"),
        ("gateway", "_INBOX_runner.>"),
        ("relay", "_INBOX_runner.>"),
        ("trainer", "_INBOX.>"),
        ("inference", "_INBOX.>"),
        ("runner", "$SYS.>"),
        ("trainer", "$SYS.>"),
        ("runner", "batches.>"),
        ("gateway", "tasks.>"),
        ("inference", "batches.>"),
        ("relay", "llm.*.requests.*"),
        ("harness", "_INBOX_runner.>"),
        ("harness", "tasks.>"),
        ("harness", "llm.*.requests"),
        ("runner", "_INBOX_harness.>"),
        ("runner", "harness.tasks.>"),
    ],
)
async def test_no_role_reads_what_it_does_not_own(connect: Connect, role: str, subject: str) -> None:
    connected = await connect(role)
    await connected.nc.subscribe(subject)
    assert await connected.refused("subscription", subject)
    refused(f"{role} subscribing to {subject}")


@pytest.mark.parametrize(
    ("role", "subject"),
    [
        ("runner", "$JS.API.STREAM.DELETE.TASKS"),
        ("runner", "$JS.API.STREAM.PURGE.TASKS"),
        ("runner", "$JS.API.STREAM.LIST"),
        ("runner", "$JS.API.CONSUMER.DELETE.TASKS.runners-x"),
        ("runner", "$JS.API.CONSUMER.CREATE.BATCHES.mine.batches.demo"),
        ("runner", "$JS.API.CONSUMER.CREATE.TASKS.all.>"),
        ("gateway", "$JS.API.CONSUMER.CREATE.TASKS.x.tasks.demo"),
        ("trainer", "$JS.API.STREAM.PURGE.BATCHES"),
        ("trainer", "$JS.API.STREAM.DELETE.OBJ_BATCH_PAYLOADS"),
        ("trainer", "$JS.API.CONSUMER.CREATE.TASKS.x.tasks.demo"),
        ("relay", "$JS.API.CONSUMER.DELETE.BATCHES.trainer"),
        ("relay", "$JS.API.STREAM.DELETE.BATCHES"),
        ("inference", "$JS.API.INFO"),
        ("inference", "$JS.API.STREAM.PURGE.POLICY_VERSIONS"),  # it reads the newest version, nothing more
        ("inference", "$JS.API.STREAM.MSG.GET.BATCHES"),
        ("trainer", "$JS.API.STREAM.DELETE.POLICY_VERSIONS"),
        ("runner", "$O.BATCH_PAYLOADS.C.forged"),
        ("gateway", "$KV.anything.key"),
        ("runner", "$JS.API.STREAM.CREATE.KV_mine"),
        ("runner", "$SYS.REQ.SERVER.PING"),
        ("inference", "llm.demo.requests"),
        ("inference", "_INBOX_trainer.x"),
        ("inference", "_INBOX_relay.x"),
        ("harness", "tasks.demo"),  # the operator submits harness tasks; a harness only takes them
        ("harness", "harness.tasks.demo"),
        ("runner", "harness.tasks.demo"),  # nor does a runner: `turnstile submit --harness` is the operator's
        ("harness", "llm.demo.requests"),  # its agents call the gateway over HTTP
        ("harness", "batches.demo"),
        ("harness", "policy.demo.versions"),
        ("harness", "$JS.API.STREAM.PURGE.TASKS"),
        ("harness", "$JS.API.STREAM.PURGE.HARNESS_TASKS"),
        ("harness", "$JS.API.CONSUMER.DELETE.HARNESS_TASKS.harness-demo"),
        ("runner", "$JS.API.STREAM.DELETE.HARNESS_TASKS"),
        ("harness", "$JS.API.CONSUMER.CREATE.BATCHES.x.batches.demo"),
        ("harness", "$KV.GATEWAY_SESSIONS.x"),
        ("runner", "$JS.API.CONSUMER.CREATE.TASKS.x.tasks.harness.demo"),
    ],
)
async def test_no_role_calls_apis_or_publishes_where_it_does_not_own(
    connect: Connect, role: str, subject: str
) -> None:
    connected = await connect(role)
    subject = api(role, subject)  # the API call it would make (unprefixed, its own account has no JetStream)
    await connected.nc.publish(subject, b"{}")
    assert await connected.refused("publish", subject)
    refused(f"{role} publishing on {subject}")


async def test_a_runner_makes_task_consumers_only_on_its_own_subjects(connect: Connect) -> None:
    policy = new_policy()
    runner = await connect("runner")
    await ensure_tasks_stream(runner.nc)
    js = jetstream(runner.nc)
    subscription = await js.pull_subscribe(
        task_subject(policy), durable=f"runners-{policy}", stream=TASKS_STREAM
    )
    await subscription.unsubscribe()  # allowed: its own subject
    with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
        await js.add_consumer(
            TASKS_STREAM, durable_name=f"sniff-{policy}", filter_subject="tasks.>", timeout=2
        )
    await wait_until(
        lambda: any(
            'permissions violation for publish to "js.runner.api.consumer' in e.lower() for e in runner.errors
        ),
        30,
        "the server to refuse the consumer",
    )
    refused("runner making a TASKS consumer over every policy")


async def test_a_harness_takes_and_acks_its_own_tasks_and_makes_no_consumer_on_a_runners(
    connect: Connect,
) -> None:
    """``serve harness`` with the harness role's own credentials: its consumer on ``harness.tasks.<policy>``
    in HARNESS_TASKS (``harness_tasks``, the code the service runs) takes a submitted group and acks it; a
    consumer on the runners' ``tasks.<policy>`` is refused."""
    policy = new_policy()
    admin, harness = await connect("admin"), await connect("harness")
    spec = TaskSpec({"id": "t", "instruction": "Write greeting.txt.", "verifier": "true"}, "t")
    await submit_tasks(admin.nc, policy, [spec], group_size=2, harness=True)
    subscription = await harness_tasks(harness.nc, policy, ack_wait=30)
    [message] = await subscription.fetch(1, timeout=30)
    await message.in_progress()
    await message.ack_sync(timeout=10)
    assert await stored(admin, HARNESS_TASKS_STREAM, task_subject(policy, harness=True)) == 0, "acked: gone"
    with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
        await jetstream(harness.nc).add_consumer(
            TASKS_STREAM, durable_name=f"sniff-{policy}", filter_subject=task_subject(policy), timeout=2
        )
    await wait_until(
        lambda: any(
            'permissions violation for publish to "js.harness.api.consumer' in e.lower()
            for e in harness.errors
        ),
        30,
        "the server to refuse the consumer",
    )
    refused("harness making a TASKS consumer on a runner's subject")


async def own_task_consumer(
    owner: Connected, policy: str, *, harness: bool
) -> nats.js.JetStreamContext.PullSubscription:
    """The durable pull consumer ``owner``'s service takes its tasks with, made with its own credentials."""
    if harness:
        return await harness_tasks(owner.nc, policy, ack_wait=60)
    return await jetstream(owner.nc).pull_subscribe(
        task_subject(policy), durable=runner_durable(policy), stream=TASKS_STREAM
    )


@pytest.mark.parametrize(("thief", "owner"), [("runner", "harness"), ("harness", "runner")])
async def test_a_runner_and_a_harness_cannot_reach_each_others_task_stream(
    connect: Connect, thief: str, owner: str
) -> None:
    """Each kind of task has a stream of its own (TASKS, HARNESS_TASKS): a pull and an ack name the stream and
    the consumer, and a NATS wildcard cannot tell ``runners-<policy>`` from ``harness-<policy>``, so on one
    stream either role could pull or ack away the other's tasks by the consumer's name. With the thief's own
    credentials, every JetStream call on the owner's stream is refused (the subjects nats-py's calls send:
    create, info, a consumer, its info, a pull) and so is the ack of a task the owner holds; both tasks stay
    queued, and the owner still takes and acks them."""
    policy = new_policy()
    admin, stealing, owning = await connect("admin"), await connect(thief), await connect(owner)
    harness = owner == "harness"
    stream, subject = task_stream(harness=harness), task_subject(policy, harness=harness)
    durable = harness_durable(policy) if harness else runner_durable(policy)
    specs = [TaskSpec({"id": n, "instruction": "x", "verifier": "true"}, str(n)) for n in range(2)]
    await submit_tasks(admin.nc, policy, specs, harness=harness)
    tasks = await own_task_consumer(owning, policy, harness=harness)
    [held] = await tasks.fetch(1, timeout=30)
    assert held.reply.startswith(f"$JS.ACK.{stream}.{durable}.")
    probes = {
        "create": (api(thief, f"$JS.API.STREAM.CREATE.{stream}"), b"{}"),
        "info": (api(thief, f"$JS.API.STREAM.INFO.{stream}"), b""),
        "a consumer": (api(thief, f"$JS.API.CONSUMER.CREATE.{stream}.{thief}-x.{subject}"), b"{}"),
        "its consumer's info": (api(thief, f"$JS.API.CONSUMER.INFO.{stream}.{durable}"), b""),
        "a pull": (api(thief, f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"), b'{"batch": 1}'),
        "an ack": (held.reply, b"+ACK"),
    }
    for what, (probe, payload) in probes.items():
        await stealing.nc.publish(probe, payload, reply=stealing.nc.new_inbox())
        assert await stealing.refused("publish", probe), what
        refused(f"{thief} on the {owner}'s {stream}: {what} ({probe})")
    assert await stored(admin, stream, subject) == 2, "nothing pulled or acked away"
    [waiting] = await tasks.fetch(1, timeout=30)  # the one the thief's pull would have taken
    for message in (held, waiting):
        await message.ack_sync(timeout=10)
    assert await stored(admin, stream, subject) == 0
    assert owning.errors == []


async def test_a_runner_submitting_harness_tasks_is_refused_in_one_clear_error(
    connect: Connect, role_nats: RoleNats, tmp_path: Path
) -> None:
    """A runner puts its own kind of task on TASKS, never a harness's (the operator submits those): `turnstile
    submit --harness` with the runner's credentials ends in one line naming the subject and who may, and
    nothing is stored on HARNESS_TASKS."""
    policy = new_policy()
    admin = await connect("admin")
    await ensure_tasks_stream(admin.nc, harness=True)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t", "instruction": "x", "verifier": "true"}\n')
    as_runner = clean_env(TURNSTILE_NATS_URL=role_nats.url("runner"))
    result = await asyncio.to_thread(
        subprocess.run,
        [*TURNSTILE, "submit", str(tasks), "--policy", policy, "--harness"],
        capture_output=True, text=True, timeout=120, env=as_runner,
    )  # fmt: skip
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert f"error: JetStream did not answer storing tasks on harness.tasks.{policy}" in output
    assert "harness tasks admin only" in output
    assert "Traceback" not in output
    assert await stored(admin, HARNESS_TASKS_STREAM, task_subject(policy, harness=True)) == 0
    refused("runner submitting harness tasks")


async def test_a_runner_reads_the_trainers_backlog_to_pace_itself_and_nothing_more(connect: Connect) -> None:
    """``serve runner --max-batches-ahead``: the runner may read the counts of a trainer's consumer on
    BATCHES (TrainerBacklog), never pull its batches."""
    policy = new_policy()
    admin, trainer, runner = await connect("admin"), await connect("trainer"), await connect("runner")
    await ensure_batches_stream(admin.nc)
    durable = f"trainer-{policy}"
    subscription = await BatchSubscription.open(trainer.nc, None, policy=policy, durable=durable)  # type: ignore[arg-type]
    try:
        await jetstream(admin.nc).publish(batch_subject(policy), b"x")
        pacer = TrainerBacklog(runner.nc, durable, max_ahead=0)
        assert await pacer.backlog() == 1
        pull = api("runner", f"$JS.API.CONSUMER.MSG.NEXT.{BATCHES_STREAM}.{durable}")
        await runner.nc.publish(pull, b"{}")
        assert await runner.refused("publish", pull)
    finally:
        await subscription.close()
    refused("runner pulling a trainer's batches")


async def test_the_trainer_quarantines_what_is_not_a_batch_of_its_policy_and_goes_on(
    connect: Connect, role_nats: RoleNats, store: EventStore
) -> None:
    policy = new_policy()
    admin, trainer = await connect("admin"), await connect("trainer")
    await ensure_batches_stream(admin.nc)
    js = jetstream(admin.nc)

    def batch(batch_id: str, for_policy: str) -> bytes:
        sample = BatchSample("s", "e", "g", ("t",), 0, 1.0, 0.5, False, (5, 6), (0, 1), (0.0, -0.5))
        return encode_batch(TrainingBatch(batch_id, for_policy, "h", 0, (sample,)))

    await js.publish(batch_subject(policy), b'{"type":"LLMError","code":"invalid_request"}')
    await js.publish(batch_subject(policy), batch("b-other", "another-policy"))
    await js.publish(batch_subject(policy), batch("b-good", policy)[:-3])  # truncated
    await js.publish(batch_subject(policy), batch("b-good", policy))
    subscription = await BatchSubscription.open(
        trainer.nc, store, policy=policy, durable=f"t{uuid.uuid4().hex[:8]}", fetch_timeout=0.5
    )
    async with subscription:
        async with asyncio.timeout(60):
            delivered = await anext(aiter(subscription))
    assert delivered.batch_id == "b-good"
    assert subscription.quarantined == 3
    refused("the trainer training on a message that is not a batch of its policy (quarantined: 3)")


# -- PostgreSQL --------------------------------------------------------------------------------------------


def run_as(database_url: str, login: tuple[str, str], *statements: str, params: Any = None) -> None:
    with psycopg.connect(login_url(database_url, login)) as connection:
        for statement in statements:
            connection.execute(statement, params if "%s" in statement else None)


def forged(position: int) -> str:
    return (
        "INSERT INTO events (position, stream, version, event_id, type, data, content_hash) "
        f"VALUES ({position}, 'episode-forged-{position}', 1, gen_random_uuid(), 'RewardAssigned', '{{}}', "
        "'\\x00')"
    )


LOCK = f"SELECT pg_advisory_xact_lock({APPEND_LOCK})"


async def test_rows_forged_into_events_are_refused_and_positions_stay_gapless(
    store: EventStore, database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    await store.append(*opened())
    writer = logins["turnstile_writer"]
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="only while holding the append lock"):
        run_as(database_url, writer, forged(2))
    refused("writer inserting into events without the append lock")
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="right after the head"):
        run_as(database_url, writer, LOCK, forged(50))
    refused("writer inserting at head+50 with the lock")
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="right after the head"):
        run_as(database_url, writer, LOCK, forged(2), forged(4))
    refused("writer leaving a gap inside one transaction")
    copy_events = "COPY events (position, stream, version, event_id, type, data, content_hash) FROM STDIN"
    with (  # COPY goes through the same check
        psycopg.connect(login_url(database_url, writer)) as connection,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
        connection.cursor().copy(copy_events) as copy,
    ):
        copy.write_row((2, "episode-copied", 1, str(uuid.uuid4()), "RewardAssigned", "{}", b"\x00"))
    refused("writer COPYing into events without the append lock")
    for login in (logins["turnstile_materializer"], logins["turnstile_reader"]):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            run_as(database_url, login, forged(2))
    refused("materializer and reader inserting into events")
    await store.append(*opened())  # the store's own appends go on
    async with store.engine.connect() as connection:
        positions = [row[0] for row in await connection.exec_driver_sql("SELECT position FROM events")]
    assert sorted(positions) == [1, 2]
    assert [event.position async for event in _tail_until(store, 2)] == [1, 2]


async def test_rows_leaving_a_gap_in_a_streams_versions_are_refused(
    store: EventStore, database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    """Migration 0015: a stream's versions are 1, 2, 3, ... whoever writes (the group commit relies on it)."""
    stream = new_stream()
    await store.append(stream, [started_in(stream)])
    writer = logins["turnstile_writer"]

    def row(position: int, version: int, name: str = stream) -> str:
        return (
            "INSERT INTO events (position, stream, version, event_id, type, data, content_hash) "
            f"VALUES ({position}, '{name}', {version}, gen_random_uuid(), 'RewardAssigned', '{{}}', '\\x00')"
        )

    gap = "versions right after its last one"
    skipped = f"{gap}.*{stream} is at version 1, got version 3"
    with pytest.raises(psycopg.errors.CheckViolation, match=skipped):
        run_as(database_url, writer, LOCK, row(2, 3))
    refused("writer skipping a version of a stream")
    other = new_stream()
    with pytest.raises(psycopg.errors.CheckViolation, match=gap):
        run_as(database_url, writer, LOCK, row(2, 1, other) + f", (3, '{other}', 3, gen_random_uuid(), "
               "'RewardAssigned', '{}', '\\x00')")  # fmt: skip
    refused("writer leaving a gap between the versions it inserts")
    copy_events = "COPY events (position, stream, version, event_id, type, data, content_hash) FROM STDIN"
    with (  # COPY goes through the same check
        psycopg.connect(login_url(database_url, writer)) as connection,
        pytest.raises(psycopg.errors.CheckViolation, match=gap),
    ):
        connection.execute(LOCK)
        with connection.cursor().copy(copy_events) as copy:
            copy.write_row((2, stream, 5, str(uuid.uuid4()), "RewardAssigned", "{}", b"\x00"))
    refused("writer COPYing a version gap")
    run_as(database_url, writer, LOCK, row(2, 2))  # the next version, right after the head: accepted
    assert [r.version for r in await store.read_stream(stream)] == [1, 2]
    assert (await store.append(stream, [started_in(stream)], 2)).version == 3  # the store's own appends go on


async def _tail_until(store: EventStore, last: int) -> Any:
    async with asyncio.timeout(30):
        async for recorded in store.tail(after=0):
            yield recorded
            if recorded.position >= last:
                return


async def test_a_read_only_role_cannot_hold_the_append_lock_and_a_held_lock_times_out_clearly(
    database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    reader = logins["turnstile_reader"]
    for function in ("pg_advisory_xact_lock", "pg_advisory_lock", "pg_advisory_xact_lock_shared",
                     "pg_try_advisory_lock", "pg_advisory_lock_shared"):  # fmt: skip
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied for function"):
            run_as(database_url, reader, f"SELECT {function}({APPEND_LOCK})")
        refused(f"reader calling {function}")
    with pytest.raises(SqlError, match="permission denied"):
        run_readonly(
            login_url(database_url, reader), f"SELECT pg_advisory_xact_lock({APPEND_LOCK}), pg_sleep(5)"
        )
    refused("turnstile sql holding the append lock")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        run_as(database_url, reader, "SET ROLE turnstile_writer")
    refused("reader switching to the writer role")

    # Whoever holds the lock (here the owner), an append waits lock_timeout, then says what to do.
    store = await EventStore.connect(database_url, lock_timeout=0.5)
    try:
        with psycopg.connect(libpq_url(database_url)) as holder:
            holder.execute(LOCK)
            with pytest.raises(StoreUnavailable, match=r"append lock was not granted within 0\.5 s"):
                await store.append(*opened())
        await store.append(*opened())  # released: appends go on
    finally:
        await store.close()


async def test_only_the_writer_appends_through_append_events_which_checks_what_the_guard_would(
    database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    """Migration 0016: the store's one-statement append runs as turnstile_appender, a role no one can log
    in as or become, which the append guard does not check twice; the function checks the streams'
    versions itself, and only turnstile_writer may call it."""
    writer_login = logins["turnstile_writer"]
    writer = await EventStore.connect(login_url(database_url, writer_login))
    try:
        stream = new_stream()
        assert (await writer.append(stream, [started_in(stream)], 0)).positions == (1,)
        assert (await writer.append(stream, [reward(), finished()], 1)).positions == (2, 3)
        assert writer.stats.one_round_trip == 2
    finally:
        await writer.close()

    def call(name: str, version: int, event_id: str = "gen_random_uuid()") -> str:
        return (
            f"SELECT append_events(ARRAY['{name}'], ARRAY[{version}], ARRAY[{event_id}], "
            "ARRAY['RewardAssigned'], ARRAY['{}'], ARRAY[NULL]::bytea[], ARRAY['{}'], ARRAY['\\x00'::bytea])"
        )

    gap = f"versions right after its last one.*{stream} is at version 3, got version 5"
    with pytest.raises(psycopg.errors.CheckViolation, match=gap):
        run_as(database_url, writer_login, call(stream, 5))
    refused("writer calling append_events with a version gap")
    with pytest.raises(psycopg.errors.CheckViolation, match="is at version 3, got version 3"):
        run_as(database_url, writer_login, call(stream, 3))
    refused("writer calling append_events with a version taken already")
    with pytest.raises(psycopg.errors.CheckViolation, match="is at version 0, got version 2"):
        run_as(database_url, writer_login, call(new_stream(), 2))
    refused("writer calling append_events for a new stream not at version 1")
    for login in (logins["turnstile_materializer"], logins["turnstile_reader"]):
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied for function"):
            run_as(database_url, login, call(new_stream(), 1))
        refused(f"{login[0]} calling append_events")
    for login in logins.values():
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            run_as(database_url, login, "SET ROLE turnstile_appender")
        refused(f"{login[0]} becoming turnstile_appender")
    event_id = f"'{uuid.uuid4()}'::uuid"
    run_as(database_url, writer_login, call(stream, 4, event_id))  # the next version: accepted
    with pytest.raises(psycopg.errors.UniqueViolation):
        run_as(database_url, writer_login, call(stream, 5, event_id))
    refused("writer calling append_events with an event id recorded already")
    shadowed = new_stream()  # a temporary table of the caller's named events does not stand in for the log
    run_as(database_url, writer_login, "CREATE TEMP TABLE events (LIKE public.events)", call(shadowed, 1))
    async with await psycopg.AsyncConnection.connect(libpq_url(database_url)) as connection:
        cursor = await connection.execute("SELECT position, stream, version FROM events ORDER BY position")
        rows = await cursor.fetchall()
    assert [(position, version) for position, _, version in rows] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 1)]
    assert rows[-1][1] == shadowed


async def test_only_the_materializer_indexes_turns_for_search_and_only_with_the_logs_words(
    store: EventStore, database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    """Migration 0024: the live materializer indexes a running episode's turns through
    ``turnstile_index_turns(positions)`` (SECURITY DEFINER), granted to its role alone; through it, it picks
    which turns are indexed and when, never what they say: the words come from the log, any event but a
    ``TurnCompleted`` is passed over, and ``turn_search`` itself stays closed to every login."""
    stream, events = opened(turn("Where is Zanzibar?"))
    start, said = (await store.append(stream, events, 0)).positions
    index = f"SELECT turnstile_index_turns(ARRAY[{start}, {said}]::bigint[])"
    for role in ("turnstile_writer", "turnstile_reader", "turnstile_trainer", "turnstile_inference"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied for function"):
            run_as(database_url, logins[role], index)
        refused(f"{role} calling turnstile_index_turns")
    materializer = logins["turnstile_materializer"]
    forged_words = (
        f"INSERT INTO turn_search (position, episode_id, words) VALUES ({said}, 'x', to_tsvector('forged'))"
    )
    for role in logins:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            run_as(database_url, logins[role], forged_words)
        refused(f"{role} writing turn_search itself")
    run_as(database_url, materializer, index, index)  # twice: the second adds nothing
    with psycopg.connect(libpq_url(database_url)) as connection:
        rows = connection.execute("SELECT position, episode_id, words::text FROM turn_search").fetchall()
    assert [(position, episode) for position, episode, _ in rows] == [(said, stream.removeprefix("episode-"))]
    assert "'zanzibar'" in rows[0][2]


# -- policy versions: engines obey only the log -------------------------------------------------------------


def version_message(policy: str, version: int, checkpoint: str) -> bytes:
    return (
        PolicyVersionPublished(policy=policy, version=version, checkpoint=checkpoint)
        .model_dump_json()
        .encode()
    )


def logged_in_inference(
    role_nats: RoleNats, policy: str, database_url: str, logins: dict[str, tuple[str, str]]
) -> InferenceConfig:
    """A scripted inference consumer with its own NATS user and its own PostgreSQL login (the one that checks
    policy versions against the log)."""
    return InferenceConfig(
        role_nats.url("inference"), policy, backend="scripted", consumer_id="c1",
        database_url=login_url(database_url, logins["turnstile_inference"]),
    )  # fmt: skip


async def test_inference_loads_only_the_versions_the_trainers_role_wrote_to_the_log(
    connect: Connect,
    role_nats: RoleNats,
    database_url: str,
    logins: dict[str, tuple[str, str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A message on policy.<policy>.versions is a doorbell: the consumer (NATS and PostgreSQL as
    ``inference``) loads a version only if the log holds it with that checkpoint, written by the trainer's
    role, and never moves backwards; it refuses, logs and counts everything else."""
    policy = new_policy()
    # The trainer's NATS user publishes the versions inference hears: here it stands for anything that gets
    # a message there (a stolen password, a server misconfigured) without a version in the log.
    trainer_nats = await connect("trainer")
    backend = RuleBackend(echo_rule)
    config = logged_in_inference(role_nats, policy, database_url, logins)

    async def ring(version: int, checkpoint: str) -> None:
        await trainer_nats.nc.publish(versions_subject(policy), version_message(policy, version, checkpoint))
        await trainer_nats.nc.flush()

    async with serving(config, backend) as service:
        await ring(2147483647, "/tmp/attacker")
        await wait_until(
            lambda: service.versions_refused["not_in_log"] == 1, 30, "the forged version refused"
        )
        assert backend.policy_version == 0
        assert (
            "refused a policy version message: version 2147483647 (checkpoint /tmp/attacker) is not in "
            "the log" in caplog.text
        )
        refused("inference loading a version the log does not hold")

        # A runner's PostgreSQL login (a turnstile_writer) cannot put a version in the log either.
        runner = await EventStore.connect(login_url(database_url, logins["turnstile_writer"]))
        try:
            with pytest.raises(Exception, match="only the trainer's role"):
                await runner.append(
                    f"policy-{policy}", [PolicyVersionPublished(policy=policy, version=5, checkpoint="/x")]
                )
        finally:
            await runner.close()
        await ring(5, "/x")
        await wait_until(
            lambda: service.versions_refused["not_in_log"] == 2, 30, "the runner's version refused"
        )
        refused("a runner appending a policy version to the log")

        trainer = await EventStore.connect(login_url(database_url, logins["turnstile_trainer"]))
        try:
            await trainer.append(
                f"policy-{policy}", [PolicyVersionPublished(policy=policy, version=1, checkpoint="/ckpt/v1")]
            )
        finally:
            await trainer.close()
        await ring(1, "/tmp/attacker")  # the trainer's version, another checkpoint
        await wait_until(
            lambda: service.versions_refused["checkpoint_mismatch"] == 1, 30, "the other checkpoint refused"
        )
        assert backend.policy_version == 0
        refused("inference loading a logged version from another checkpoint")
        await ring(1, "/ckpt/v1")
        await wait_until(lambda: backend.policy_version == 1, 30, "the trainer's version 1 loaded")
        assert backend.loaded == [(1, "/ckpt/v1")]
        await ring(0, "/ckpt/v0")  # backwards: left alone, not even looked up
        await ring(1, "/ckpt/v1")  # heard again
        await ring(2147483647, "/tmp/attacker")  # a marker: once it is refused, the two before were handled
        await wait_until(lambda: service.versions_refused["not_in_log"] == 3, 30, "the marker refused")
        assert backend.policy_version == 1
        assert backend.loaded == [(1, "/ckpt/v1")]
    assert sum(service.versions_refused.values()) == 4


async def test_inference_catches_up_at_start_to_its_policys_newest_logged_version(
    role_nats: RoleNats, database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    """Versions logged while no consumer listened (before it started, or while NATS was away) are loaded from
    the log: the newest of its own policy, never another policy's newer one."""
    policy, other = new_policy(), new_policy()
    trainer = await EventStore.connect(login_url(database_url, logins["turnstile_trainer"]))
    try:
        for name, version in ((policy, 1), (policy, 3), (other, 9)):
            await trainer.append(
                f"policy-{name}",
                [PolicyVersionPublished(policy=name, version=version, checkpoint=f"/ckpt/{name}/v{version}")],
            )
    finally:
        await trainer.close()
    backend = RuleBackend(echo_rule)
    config = logged_in_inference(role_nats, policy, database_url, logins)
    async with serving(config, backend):
        await wait_until(lambda: backend.policy_version == 3, 30, "the newest logged version loaded at start")
    assert backend.loaded == [(3, f"/ckpt/{policy}/v3")]


async def test_the_inference_login_reads_policy_versions_and_nothing_else(
    database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    login = logins["turnstile_inference"]
    run_as(database_url, login, "SELECT version, checkpoint FROM policy_versions")
    for statement in (
        "SELECT * FROM events LIMIT 1",
        "SELECT * FROM episodes LIMIT 1",
        "SELECT * FROM trained_batches LIMIT 1",
        forged(1),
        "SELECT append_events(ARRAY['policy-x'], ARRAY[1], ARRAY[gen_random_uuid()], "
        "ARRAY['PolicyVersionPublished'], ARRAY['{}'], ARRAY[NULL]::bytea[], ARRAY['{}'], "
        "ARRAY['\\x00'::bytea])",
        "SET ROLE turnstile_trainer",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            run_as(database_url, login, statement)
        refused(f"inference: {statement[:60]}")


async def test_only_the_trainers_role_writes_policy_versions_by_either_append_path(
    database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    """append_events checks the caller's login; the append guard every other INSERT (a writer holding the
    append lock, as the store's batched COPY does)."""
    data = '{"type": "PolicyVersionPublished", "policy": "x", "version": 7, "checkpoint": "/evil"}'

    def call(stream: str, kind: str) -> str:
        return (
            f"SELECT append_events(ARRAY['{stream}'], ARRAY[1], ARRAY[gen_random_uuid()], ARRAY['{kind}'], "
            f"ARRAY['{data}'], ARRAY[NULL]::bytea[], ARRAY['{{}}'], ARRAY['\\x00'::bytea])"
        )

    def insert(stream: str, kind: str) -> str:
        return (
            "INSERT INTO events (position, stream, version, event_id, type, data, content_hash) "
            f"SELECT coalesce(max(position), 0) + 1, '{stream}', 1, gen_random_uuid(), '{kind}', '{data}', "
            "'\\x00' FROM events"
        )

    for login in (logins["turnstile_writer"], logins["turnstile_materializer"]):
        for stream, kind in (
            ("policy-x", "PolicyVersionPublished"),
            ("policy-y", "RewardAssigned"),
            (new_stream(), "PolicyVersionPublished"),
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                run_as(database_url, login, call(stream, kind))
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                run_as(
                    database_url,
                    login,
                    f"SELECT pg_advisory_xact_lock({APPEND_LOCK})",
                    insert(stream, kind),
                )
            refused(f"{login[0]} appending {kind} to {stream}")
    trainer = logins["turnstile_trainer"]
    run_as(database_url, trainer, call("policy-x", "PolicyVersionPublished"))
    run_as(
        database_url,
        trainer,
        f"SELECT pg_advisory_xact_lock({APPEND_LOCK})",
        insert("policy-z", "PolicyVersionPublished"),
    )
    async with await psycopg.AsyncConnection.connect(libpq_url(database_url)) as connection:
        cursor = await connection.execute(
            "SELECT stream, version, checkpoint FROM policy_versions ORDER BY position"
        )
        assert await cursor.fetchall() == [("policy-x", 7, "/evil"), ("policy-z", 7, "/evil")]


def test_the_read_only_roles_hold_no_write_privilege_on_anything(
    database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    """turnstile_reader (`turnstile sql`, the episode browser) and turnstile_inference write nothing: a reader
    that could INSERT into trained_batches would make a trainer skip batches it never trained."""
    with psycopg.connect(libpq_url(database_url)) as connection:
        granted = connection.execute(
            "SELECT r.role, c.relname, p.privilege "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace, "
            "unnest(ARRAY['turnstile_reader', 'turnstile_inference']) AS r(role), "
            "unnest(ARRAY['INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES', 'TRIGGER']) "
            "AS p(privilege) "
            "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'v', 'm', 'p') "
            "AND has_table_privilege(r.role, c.oid, p.privilege)"
        ).fetchall()
    assert granted == []
    reader = logins["turnstile_reader"]
    for statement in (
        "INSERT INTO trained_batches (trainer, batch_id, policy, policy_version, outcome) "
        "VALUES ('trainer', 'b-never-trained', 'demo', 1, 'trained')",
        "DELETE FROM trained_batches",
        "UPDATE checkpoints SET position = 0",
        "INSERT INTO runners (runner_id) VALUES ('x')",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            run_as(database_url, reader, statement)
        refused(f"reader: {statement[:50]}")


async def pull_to(
    runner: Connected, policy: str, reply: str, forged: bytes
) -> nats.js.JetStreamContext.PullSubscription:
    """The attack: the runner puts ``forged`` twice on its own task stream, pulls the first with the reply
    subject ``reply`` (raw MSG.NEXT: the server checks the subject, not the reply) and the second the normal
    way (a marker: once it has arrived, JetStream has answered the first)."""
    js = jetstream(runner.nc)
    for _ in range(2):
        await js.publish(task_subject(policy), forged)  # its own stream: allowed
    durable = f"runners-{policy}"
    pulled = await js.pull_subscribe(task_subject(policy), durable=durable, stream=TASKS_STREAM)
    await runner.nc.publish(
        api("runner", f"$JS.API.CONSUMER.MSG.NEXT.{TASKS_STREAM}.{durable}"), b'{"batch": 1}', reply=reply
    )
    [second] = await pulled.fetch(1, timeout=30)
    assert second.data == forged
    await second.ack()
    return pulled


async def test_a_runners_forged_version_pulled_onto_the_versions_subject_is_never_loaded(
    connect: Connect, role_nats: RoleNats, database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    """The attack of the report, with the runner's own credentials, against a consumer logged in as
    ``inference`` to both servers: before, it loaded version 2147483647 from the runner's path and ignored
    the trainer's real version 1 after it. Now the pulled message lands in the runner's own account (the test
    below) and never reaches the consumer; a version sent on the subject without being in the log (here by
    the one role that may publish there, the trainer) is refused all the same."""
    policy = new_policy()
    admin, runner = await connect("admin"), await connect("runner")
    await ensure_tasks_stream(admin.nc)
    backend = RuleBackend(echo_rule)
    config = logged_in_inference(role_nats, policy, database_url, logins)
    async with serving(config, backend) as service:
        forged = version_message(policy, 2147483647, "/tmp/x")
        await pull_to(runner, policy, versions_subject(policy), forged)  # JetStream answered it: nowhere
        trainer_nats = (await connect("trainer")).nc
        await trainer_nats.publish(versions_subject(policy), forged)  # heard, but not in the log
        await wait_until(
            lambda: service.versions_refused["not_in_log"] >= 1, 30, "the forged version refused"
        )
        assert backend.loaded == []
        refused("inference loading the version a runner pulled onto policy.<policy>.versions")
        trainer = await EventStore.connect(login_url(database_url, logins["turnstile_trainer"]))
        try:  # the trainer's real version 1 still loads (its own publish, as publish_policy_version does)
            await publish_policy_version(trainer, trainer_nats, policy, 1, "/ckpt/v1")
        finally:
            await trainer.close()
        await wait_until(lambda: backend.policy_version == 1, 30, "the trainer's version 1 loaded")
        assert backend.loaded == [(1, "/ckpt/v1")]
        assert service.versions_refused["not_in_log"] == 1  # the trainer's; the runner's never arrived


async def test_no_role_has_jetstream_deliver_to_a_subject_it_may_not_publish_to(
    connect: Connect, role_nats: RoleNats
) -> None:
    """NATS checks the subject a client publishes to, not the reply subject it names, and JetStream sends a
    pulled message or an API response to that reply subject. The attack found against per-user permissions:
    a runner puts a forged version on its own task stream and pulls it with the reply subject
    policy.<policy>.versions (every inference consumer would hear it), and asks for STREAM.INFO with the
    reply subject batches.<policy> (stored in BATCHES). With an account per role a reply lands in the
    requester's own account only: deploy/nats.conf puts each role in an account of its own and JetStream in
    another, whose API each role imports under its own prefix; the server answers through the import, in the
    account of the requester, where no other role listens."""
    policy = new_policy()
    admin, runner = await connect("admin"), await connect("runner")
    await ensure_tasks_stream(admin.nc)
    await ensure_batches_stream(admin.nc)
    inference = await connect("inference")
    versions = await admin.nc.subscribe(versions_subject(policy))
    heard = await inference.nc.subscribe(versions_subject(policy))
    await admin.nc.flush()
    await inference.nc.flush()
    js = jetstream(runner.nc)
    await runner.nc.publish(
        api("runner", f"$JS.API.STREAM.INFO.{TASKS_STREAM}"), b"", reply=batch_subject(policy)
    )
    await pull_to(runner, policy, versions_subject(policy), version_message(policy, 2147483647, "/tmp/x"))
    await js.stream_info(TASKS_STREAM)
    await admin.nc.flush()
    await inference.nc.flush()
    for subscription in (versions, heard):  # neither the operator nor an inference consumer hears it
        with pytest.raises(nats.errors.TimeoutError):
            await subscription.next_msg(timeout=0.5)
    refused("a runner's pulled message delivered to policy.<policy>.versions")
    assert await stored(admin, BATCHES_STREAM, batch_subject(policy)) == 0
    refused("a JetStream API response delivered into BATCHES")
    assert runner.errors == []
