"""The ``turnstile`` command as a user runs it: real processes, real servers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nats
import psycopg
import pytest

from pipeline.dev.embedded import free_port
from pipeline.inference.client import NatsLLMClient
from pipeline.runners import HARNESS_TASKS_STREAM, TASKS_STREAM, ensure_tasks_stream
from schemas import ChatMessage, LLMRequest, LLMResponse
from tests.conftest import Servers, login_url
from tests.support.processes import stopping

TURNSTILE = [sys.executable, "-m", "consumers.cli"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    return {**env, **extra}


def start_up(data_dir: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    process = subprocess.Popen(
        [*TURNSTILE, "up", "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=clean_env(),
    )
    exports: dict[str, str] = {}
    deadline = time.monotonic() + 120
    assert process.stdout is not None
    try:
        while len(exports) < 4:
            line = process.stdout.readline()
            assert line, f"`turnstile up` ended before printing its exports (exit {process.poll()})"
            assert time.monotonic() < deadline
            if line.startswith("export "):
                name, _, value = line.removeprefix("export ").strip().partition("=")
                exports[name] = value
    except BaseException:  # stopped unless it printed its exports (then the caller stops it)
        process.kill()
        process.wait()
        raise
    return process, exports


def stop(process: subprocess.Popen[str]) -> int:
    """SIGTERM and its exit status; killed if it has not exited within 60 s (then the wait fails)."""
    process.send_signal(signal.SIGTERM)
    with stopping(process):
        return process.wait(60)


async def nats_has_jetstream(url: str) -> bool:
    client = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        info = await client.jetstream().account_info()
        return info is not None
    finally:
        await client.close()


def test_up_starts_migrated_servers_keeps_data_and_stops_on_sigterm(server_dir: Path) -> None:
    process, exports = start_up(server_dir / "data")
    try:
        database_url, nats_url = exports["TURNSTILE_DATABASE_URL"], exports["TURNSTILE_NATS_URL"]
        with psycopg.connect(database_url) as connection:
            assert connection.execute("SELECT version_num FROM alembic_version").fetchone() is not None
            connection.execute("INSERT INTO checkpoints (name, position) VALUES ('kept-across-restarts', 42)")
        assert asyncio.run(nats_has_jetstream(nats_url))
        assert (server_dir / "data" / "servers.env").read_text().count("export ") == 4
        # everyday logins are not superusers; the superuser is printed for migrations only
        superuser = "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
        for name, expected in (("TURNSTILE_DATABASE_URL", False), ("TURNSTILE_READER_URL", False),
                               ("TURNSTILE_ADMIN_DATABASE_URL", True)):  # fmt: skip
            with psycopg.connect(exports[name]) as connection:
                assert connection.execute(superuser).fetchone() == (expected,), name
        # other commands run in that directory find the servers without any TURNSTILE_*_URL set
        escape = (
            "SELECT set_config('role', session_user, true) AS login, current_setting('is_superuser') AS su"
        )
        sql = subprocess.run(
            [*TURNSTILE, "sql", escape, "--json"], env=clean_env(TURNSTILE_DATA_DIR=str(server_dir / "data")),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert sql.returncode == 0, sql.stderr
        assert json.loads(sql.stdout) == [{"login": "turnstile_analyst", "su": "off"}]
        inside = subprocess.run(  # run inside the directory given to --data-dir: found too
            [*TURNSTILE, "sql", "SELECT 1 AS one", "--json"], env=clean_env(), cwd=server_dir / "data",
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert inside.returncode == 0, inside.stderr
        assert json.loads(inside.stdout) == [{"one": 1}]
        migrated = subprocess.run(
            [*TURNSTILE, "migrate"], env=clean_env(TURNSTILE_DATA_DIR=str(server_dir / "data")),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert migrated.returncode == 0, migrated.stderr
    finally:
        assert stop(process) == 0
    assert not (server_dir / "data" / "servers.env").exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(database_url, connect_timeout=2)

    process, exports = start_up(server_dir / "data")
    try:
        with psycopg.connect(exports["TURNSTILE_DATABASE_URL"]) as connection:
            row = connection.execute(
                "SELECT position FROM checkpoints WHERE name = 'kept-across-restarts'"
            ).fetchone()
            assert row == (42,)
    finally:
        assert stop(process) == 0


def test_migrate_is_idempotent(database_url: str) -> None:
    for _ in range(2):
        result = subprocess.run(
            [*TURNSTILE, "migrate"],
            capture_output=True,
            text=True,
            env=clean_env(TURNSTILE_DATABASE_URL=database_url),
        )
        assert result.returncode == 0, result.stderr
    with psycopg.connect(database_url) as connection:
        assert connection.execute("SELECT count(*) FROM alembic_version").fetchone() == (1,)


def test_migrate_without_a_database_says_what_to_set() -> None:
    result = subprocess.run([*TURNSTILE, "migrate"], capture_output=True, text=True, env=clean_env())
    assert result.returncode == 2
    assert "TURNSTILE_DATABASE_URL" in result.stderr
    assert "turnstile up" in result.stderr


def test_model_init_tiny_and_serve_inference_answer_over_nats(tmp_path: Path, servers: Servers) -> None:
    model_dir = tmp_path / "tiny"
    built = subprocess.run([*TURNSTILE, "model", "init-tiny", str(model_dir)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert (model_dir / "model.safetensors").exists()
    policy = "cli-test"
    consumer = subprocess.Popen(
        [
            *TURNSTILE,
            "serve",
            "inference",
            "--policy",
            policy,
            "--model",
            str(model_dir),
            "--consumer-id",
            "cli-1",
        ],
        env=clean_env(TURNSTILE_NATS_URL=servers.nats_url, HF_HUB_OFFLINE="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        response = asyncio.run(ask_when_ready(servers.nats_url, policy))
        assert response.consumer_id == "cli-1"
        assert len(response.completion_token_ids) == len(response.completion_logprobs) > 0
    finally:
        assert stop(consumer) == 0, consumer.stderr.read() if consumer.stderr else ""


def test_model_init_long_and_serve_inference_with_a_script_answer_the_scripted_reply(
    tmp_path: Path, servers: Servers, long_model_dir: Path
) -> None:
    model_dir = tmp_path / "long"
    built = subprocess.run([*TURNSTILE, "model", "init-long", str(model_dir)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert json.loads((model_dir / "config.json").read_text())["max_position_embeddings"] == 131072
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        # offline and deterministic: byte-identical to the fixture's build
        assert (model_dir / name).read_bytes() == (long_model_dir / name).read_bytes(), name
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"rules": [{"when": {"tools": False}, "reply": {"content": "Scripted."}}]}))
    policy = "cli-script-test"
    consumer = subprocess.Popen(
        [
            *TURNSTILE,
            "serve",
            "inference",
            "--policy",
            policy,
            "--model",
            str(model_dir),
            "--script",
            str(script),
        ],
        env=clean_env(TURNSTILE_NATS_URL=servers.nats_url, HF_HUB_OFFLINE="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        response = asyncio.run(ask_when_ready(servers.nats_url, policy))
        assert (response.text, response.finish_reason) == ("Scripted.", "stop")
        assert len(response.completion_token_ids) == len(response.completion_logprobs) > 1
    finally:
        assert stop(consumer) == 0, consumer.stderr.read() if consumer.stderr else ""


async def ask_when_ready(nats_url: str, policy: str) -> LLMResponse:
    client = await NatsLLMClient.connect(nats_url, wait_for_consumer=120)
    try:
        request = LLMRequest(policy=policy, messages=[ChatMessage(role="user", content="hi")])
        return await client(request)
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        (["up"], "[default: $TURNSTILE_DATA_DIR or .turnstile]"),
        (["demo"], "[default: $TURNSTILE_DATA_DIR or .turnstile]"),
        (["plot"], "[default: $TURNSTILE_DATA_DIR/plots or .turnstile/plots]"),
        (["run"], "LLM turns an episode may take [default: no limit]"),
        (["serve", "inference"], "[default: host-pid-random]"),
        (["serve", "trainer"], "skip batches more than N versions behind [default: never]"),
        (["serve", "gateway"], "starting one more gets 429 [default: no limit]"),
    ],
)
def test_help_shows_the_defaults_written_in_words(command: list[str], shown: str) -> None:
    result = subprocess.run(
        [*TURNSTILE, *command, "--help"], capture_output=True, text=True, timeout=60,
        env=clean_env(COLUMNS="400"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert shown in result.stdout


def test_help_shows_no_type_beside_an_option_that_takes_no_value() -> None:
    result = subprocess.run(
        [*TURNSTILE, "replay", "--help"], capture_output=True, text=True, timeout=60,
        env=clean_env(COLUMNS="200"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    options = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("│ --")}
    assert "<int>" in options["--until"]  # an option that takes a value says which
    for flag in ("--tokens", "--json", "--rerun", "--all", "--help"):
        assert "<bool>" not in options[flag], options[flag]


def test_plot_writes_into_the_data_directory_by_default(
    database_url: str, logins: dict[str, tuple[str, str]], tmp_path: Path
) -> None:
    reader_url = login_url(database_url, logins["turnstile_reader"])
    env = clean_env(TURNSTILE_DATABASE_URL=database_url, TURNSTILE_READER_URL=reader_url)
    done = subprocess.run(
        [*TURNSTILE, "plot", "staleness", "--policy", "nobody"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / ".turnstile" / "plots" / "staleness.png").is_file()
    assert not (tmp_path / "plots").exists()


def test_a_command_that_cannot_reach_its_servers_says_so_in_one_line_at_once(tmp_path: Path) -> None:
    """By hand, "connection refused" is the answer: one line naming the server, the refusal and the setting
    (it printed 69 lines over 60 s: nats-py's two lines and stamina's per attempt). ``--connect-timeout``
    still waits, for scripts started before their servers."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": 1}\n')
    closed = free_port()
    commands = {
        "submit": ["submit", str(tasks), "--policy", "p"],
        "run": ["run", "--agent", "pipeline.examples.digits_or_capitals:DigitsOrCapitalsAgent",
                "--tasks", str(tasks), "--policy", "p"],
    }  # fmt: skip
    env = clean_env(
        TURNSTILE_NATS_URL=f"nats://127.0.0.1:{closed}",
        TURNSTILE_DATABASE_URL=f"postgresql://postgres@127.0.0.1:{closed}/turnstile",
        COLUMNS="60",  # a narrow terminal: the line is not wrapped either
    )
    for name, args in commands.items():
        started = time.monotonic()
        result = subprocess.run([*TURNSTILE, *args], capture_output=True, text=True, timeout=120, env=env)
        took = time.monotonic() - started
        lines = (result.stdout + result.stderr).strip().splitlines()
        assert result.returncode != 0, name
        assert len(lines) == 1, (name, lines)
        assert lines[0].startswith("error: cannot reach "), lines
        assert "(tried once: --connect-timeout waits)" in lines[0]
        assert "refused" in lines[0] or "Connect call failed" in lines[0], lines
        assert took < 60, f"{name} took {took:.0f} s: it retried for the services' 60 s window"


def test_submit_to_an_unreachable_nats_ends_in_one_clear_error(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": 1}\n')
    result = subprocess.run(
        [*TURNSTILE, "submit", str(tasks), "--policy", "p", "--connect-timeout", "2"],
        capture_output=True, text=True, timeout=120,
        env=clean_env(TURNSTILE_NATS_URL=f"nats://127.0.0.1:{free_port()}"),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "cannot reach NATS at nats://127.0.0.1:" in output
    assert "TURNSTILE_NATS_URL" in output
    assert "Traceback" not in output


async def test_submit_harness_names_the_harness_tasks_left_where_they_were_queued_before(
    servers: Servers, tmp_path: Path
) -> None:
    """Before HARNESS_TASKS, harness tasks were queued on ``tasks.harness.<policy>`` in TASKS, where no
    harness takes them now: `turnstile submit --harness` (the operator) says how many wait there and what to
    do."""
    policy = f"upgraded{uuid.uuid4().hex[:8]}"
    old = f"tasks.harness.{policy}"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t", "instruction": "x", "verifier": "true"}\n')
    connection = await nats.connect(servers.nats_url)
    js = connection.jetstream()
    try:
        await ensure_tasks_stream(connection)
        for _ in range(2):
            await js.publish(old, b"{}")  # as an older `turnstile submit --harness` left them
        result = await asyncio.to_thread(
            subprocess.run,
            [*TURNSTILE, "submit", str(tasks), "--policy", policy, "--harness"],
            capture_output=True, text=True, timeout=120, env=clean_env(TURNSTILE_NATS_URL=servers.nats_url),
        )  # fmt: skip
        output = " ".join((result.stdout + result.stderr).split())
        assert result.returncode == 0, output
        assert f"submitted 1 tasks to harness.tasks.{policy}" in output
        assert f"2 harness tasks still wait on {old} in TASKS" in output
        assert f"nats stream purge TASKS --subject {old}" in output
        assert f"nats consumer rm TASKS harness-{policy}" in output
        new = await js.stream_info(HARNESS_TASKS_STREAM, subjects_filter=f"harness.tasks.{policy}")
        assert new.state.subjects == {f"harness.tasks.{policy}": 1}
    finally:
        await js.purge_stream(TASKS_STREAM, subject=old)
        await js.purge_stream(HARNESS_TASKS_STREAM, subject=f"harness.tasks.{policy}")
        await connection.close()
