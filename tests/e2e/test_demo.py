"""`turnstile demo`, shortened: the closed loop learns, every trained batch traces back to its turns, and a
second run resumes on the same data."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import psycopg
import pytest

from pipeline.dev.embedded import EmbeddedServers
from tests.support.demo import browse, run_demo, turnstile_up

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
@pytest.mark.demo  # about 3 minutes: a step of its own in .ci/run, so the main run stays near 15
def test_the_demo_learns_and_every_trained_batch_traces_back_to_its_turns(server_dir: Path) -> None:
    data_dir = server_dir / ".turnstile"  # where the README's commands after the demo look
    first = run_demo(data_dir, 40)
    (mean_first, ci_first, n_first) = first["first_window"]  # type: ignore[misc]
    (mean_last, ci_last, n_last) = first["last_window"]  # type: ignore[misc]
    assert n_first >= 100
    assert n_last >= 100
    assert mean_last - ci_last > mean_first + ci_first  # 95% intervals apart: the reward went up
    assert first["improved"] is True
    assert int(first["batches_trained"]) >= 40  # type: ignore[call-overload]
    assert (data_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("reward_by_version", "staleness", "throughput"):  # drawn through the reader login
        assert (data_dir / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    second = run_demo(data_dir, 5)  # the same data directory: everything resumes
    with EmbeddedServers(data_dir) as servers, psycopg.connect(servers.postgres.url) as connection:
        versions = [v for (v,) in connection.execute(
            "SELECT (data->>'version')::int FROM events WHERE stream = 'policy-demo' ORDER BY position"
        )]  # fmt: skip
        assert versions == sorted(set(versions))  # one line of versions across both runs
        assert versions[-1] >= int(first["policy_version"])  # type: ignore[call-overload]
        untraced = connection.execute(
            """
            SELECT count(*) FROM trained_batches t
            WHERE t.outcome = 'trained' AND NOT EXISTS (
                SELECT 1 FROM samples s JOIN turns u ON u.turn_id = ANY (s.turn_ids)
                JOIN episodes e ON e.episode_id = s.episode_id
                WHERE s.batch_id = t.batch_id)
            """
        ).fetchone()
        assert untraced == (0,)
        trained = connection.execute(
            "SELECT count(*) FROM trained_batches WHERE outcome = 'trained'"
        ).fetchone()
        assert trained is not None
        assert trained[0] == int(first["batches_trained"]) + int(second["batches_trained"])  # type: ignore[call-overload]
        open_episodes = connection.execute(
            "SELECT count(*) FROM events s WHERE type = 'EpisodeStarted' AND NOT EXISTS "
            "(SELECT 1 FROM events f WHERE f.stream = s.stream AND f.type = 'EpisodeFinished')"
        ).fetchone()
        assert open_episodes == (0,)  # stopping closed every open episode (cancelled)

    readme_commands_after_the_demo(server_dir)


def readme_commands_after_the_demo(directory: Path) -> None:
    """The README's commands after the demo, as written, run in the directory the demo ran in: ``turnstile
    up &`` in the background, each query answered, the plots drawn, the browser serving episodes."""
    text = README.read_text()
    block = re.search(r"Afterwards, from the same directory:\n\n```bash\n(.*?)```", text, re.S)
    assert block is not None, "README: the block of commands after the demo moved; update this test"
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert lines[0] == "turnstile up &", lines
    with turnstile_up(directory) as env:
        for line in lines[1:]:
            command = shlex.split(line)
            if command[:2] == ["turnstile", "ui"]:
                browse(command, directory, env)
                continue
            done = subprocess.run(
                command, cwd=directory, env=env, capture_output=True, text=True, timeout=300
            )
            assert done.returncode == 0, f"{line}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
            if command[:2] == ["turnstile", "sql"]:
                assert "demo" in done.stdout, done.stdout  # the demo's policy has rows
            if command[:2] == ["turnstile", "plot"]:
                assert (directory / ".turnstile" / "plots" / "reward_curve.png").exists()
