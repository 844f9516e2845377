"""What the demo tests share: a run of ``turnstile demo``, ``turnstile up`` in the background, and the
episode browser's first page."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

TURNSTILE = [sys.executable, "-m", "consumers.cli"]


def run_demo(data_dir: Path, batches: int, *options: str) -> dict[str, object]:
    """``turnstile demo OPTIONS``, a run of a fixed amount of training (``batches``), not of a fixed time: a
    loaded machine trains as much, only later. The 8 minutes are a bound on a stuck run. Its summary."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    done = subprocess.run(
        [*TURNSTILE, "demo", "--until-batches", str(batches), "--minutes", "8", "--data-dir", str(data_dir),
         "--seed", "0", *options],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "turnstile demo: summary" in done.stdout
    assert "turnstile sql" in done.stdout
    summary: dict[str, object] = json.loads((data_dir / "summary.json").read_text())
    return summary


@contextlib.contextmanager
def turnstile_up(directory: Path) -> Iterator[dict[str, str]]:
    """``turnstile up`` in ``directory`` (its ``.turnstile`` data), in the background until the block ends;
    the environment in which ``turnstile ...`` commands reach it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    up = subprocess.Popen(
        ["turnstile", "up"],
        cwd=directory,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert up.stdout is not None
        for output in up.stdout:  # bounded by the servers' own start-up timeouts
            if "ready" in output:
                break
        else:
            raise AssertionError(f"turnstile up ended: {up.wait()}")
        yield env
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)


def browse(command: list[str], directory: Path, env: dict[str, str]) -> None:
    """``turnstile ui ...`` as written but on a free port: its episode list has the demo's episodes."""
    ui = subprocess.Popen(
        [*command, "--port", "0"], cwd=directory, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert ui.stdout is not None
        for output in ui.stdout:
            found = re.search(r"episode browser on (http://\S+/episodes)", output)
            if found:
                break
        else:
            raise AssertionError(f"turnstile ui ended: {ui.wait()}")
        with urllib.request.urlopen(found.group(1), timeout=60) as page:
            assert "demo" in page.read().decode()
    finally:
        ui.send_signal(signal.SIGINT)
        ui.wait(timeout=120)
