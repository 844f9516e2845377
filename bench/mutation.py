"""Mutation testing: mutmut changes the code one thing at a time and reruns the tests that reach the changed
function; a mutant that no test kills is a promise no test checks.

    python bench/mutation.py pure       # the rules whose tests need no server: about 2 minutes here
    python bench/mutation.py servers    # the server-backed promises, on embedded PostgreSQL + NATS: ~25 min
    python bench/mutation.py servers --only 'pipeline.inference.service.*'   # a part of a suite

Suites (``SUITES``): ``pure`` mutates the append rules both stores share and the trajectory math; ``servers``
mutates the functions behind the README's promises that need real servers: the event store's append path
and tail, the session's turns, the inference consumer's de-duplication, the materializer's fold, the relay
and the trainer's bookkeeping. Each suite runs in a copy of the repository under ``build/mutation/<suite>/``
with its own ``[tool.mutmut]`` (mutmut reads its configuration from ``pyproject.toml`` only), so the suites
never share mutants. Prints the score per module and writes the survivors to ``survivors.txt`` there; show
one with ``cd build/mutation/<suite> && mutmut show NAME``. Needs ``pip install -e '.[mutation]'``; not run
by CI (too slow for every stop).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Suite:
    modules: tuple[str, ...]  # files mutmut mutates
    tests: tuple[str, ...]  # test files it may run
    deselect: str = ""  # a pytest -k expression leaving out tests too slow to rerun per mutant
    functions: tuple[str, ...] = ()  # mutant name patterns (fnmatch) when only some functions matter
    servers: bool = False


SUITES: dict[str, Suite] = {
    "pure": Suite(
        modules=("pipeline/log/appends.py", "pipeline/materialize/trajectory.py"),
        tests=(
            "tests/unit/test_append_plan.py",
            "tests/integration/test_store_contract.py",
            "tests/unit/test_trajectory.py",
            "tests/unit/test_session_logic.py",
        ),
        deselect="not TestEventStore",
    ),
    "servers": Suite(
        modules=(
            "pipeline/log/store.py",
            "pipeline/episodes/session.py",
            "pipeline/inference/service.py",
            "pipeline/materialize/fold.py",
            "pipeline/batches/relay.py",
            "pipeline/training/subscription.py",
        ),
        tests=(
            "tests/integration/test_eventstore.py",
            "tests/integration/test_store_contract.py",
            "tests/integration/test_tail.py",
            "tests/integration/test_episodes.py",
            "tests/unit/test_session_logic.py",
            "tests/integration/test_llm_nats.py",
            "tests/integration/test_materializer.py",
            "tests/integration/test_relay.py",
            "tests/integration/test_trainer.py",
            "tests/integration/test_security.py",
        ),
        # each of these starts processes or trains for seconds; the tests left in still cover each function
        deselect="not killed and not another_process and not rematerialize_command and not refuses_bad",
        functions=(
            "pipeline.log.store.xǁEventStoreǁappend__*",
            "pipeline.log.store.xǁEventStoreǁtail__*",
            "pipeline.log.store.xǁEventStoreǁread_stream__*",
            "pipeline.log.store.xǁ_Writerǁcommit*",
            "pipeline.log.store.x_write_appends__*",
            "pipeline.episodes.session.xǁEpisodeSessionǁ*",
            "pipeline.inference.service.xǁInferenceServiceǁhandle__*",
            "pipeline.inference.service.xǁInferenceServiceǁ_answer__*",
            "pipeline.inference.service.xǁInferenceServiceǁon_version__*",
            "pipeline.inference.service.xǁInferenceServiceǁcatch_up__*",
            "pipeline.materialize.fold.xǁFoldǁ*",
            "pipeline.batches.relay.xǁOutboxRelayǁ_publish*",
            "pipeline.batches.relay.x_read_batch_message__*",
            "pipeline.training.subscription.xǁBatchSubscriptionǁ_batches__*",
            "pipeline.training.subscription.xǁBatchSubscriptionǁ_recorded__*",
            "pipeline.training.subscription.xǁBatchSubscriptionǁcommit__*",
            "pipeline.training.subscription.xǁBatchSubscriptionǁtrained_*",
        ),
        servers=True,
    ),
}


def mutmut_config(suite: Suite) -> str:
    def strings(values: tuple[str, ...] | list[str]) -> str:
        return "[" + ", ".join(f'"{value}"' for value in values) + "]"

    options = ["-p", "no:cacheprovider", *(["-k", suite.deselect] if suite.deselect else [])]
    return (
        "[tool.mutmut]\n"
        'source_paths = ["pipeline", "schemas", "consumers", "migrations"]\n'
        f"only_mutate = {strings([f'*{module}' for module in suite.modules])}\n"
        'also_copy = ["tests", "deploy"]\n'  # deploy: tests read its configs (nats.conf, check_compose)
        f"pytest_add_cli_args_test_selection = {strings(suite.tests)}\n"
        f"pytest_add_cli_args = {strings(options)}\n"
    )


def copy_repository(target: Path, suite: Suite) -> None:
    """The working tree's files (tracked and untracked, not ignored) with this suite's ``[tool.mutmut]``."""
    if target.exists():
        shutil.rmtree(target)
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    pyproject = (target / "pyproject.toml").read_text()
    start = pyproject.index("[tool.mutmut]")
    end = pyproject.find("\n[", start + 1)
    rest = pyproject[end + 1 :] if end != -1 else ""
    rewritten = pyproject[:start] + mutmut_config(suite) + ("\n" + rest if rest else "")
    tomllib.loads(rewritten)  # still valid TOML
    (target / "pyproject.toml").write_text(rewritten)


def scores(results: str) -> tuple[dict[str, collections.Counter[str]], list[str]]:
    """Outcomes per module from ``mutmut results --all true``, leaving out mutants this run did not try."""
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    survivors = []
    for line in results.splitlines():
        found = re.match(r"\s*([\w.]+)\.x\S*__mutmut_\d+: ([\w ]+)$", line)
        if found and found[2] != "not checked":
            counts[found[1]][found[2]] += 1
            if found[2] == "survived":
                survivors.append(line.split(":")[0].strip())
    return counts, survivors


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--only", action="append", default=[], help="mutant name patterns (fnmatch)")
    args = parser.parse_args()
    suite = SUITES[args.suite]
    work = ROOT / "build" / "mutation" / args.suite
    copy_repository(work, suite)
    mutmut = Path(sys.executable).parent / "mutmut"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    # mutmut starts a pytest session per mutant, and each prunes all but the newest basetemps under its temp
    # root: a root of its own keeps that away from the basetemps of test runs on this machine.
    temproot = work / "pytest-temproot"
    temproot.mkdir()
    env["PYTEST_DEBUG_TEMPROOT"] = str(temproot)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="turnstile-mutation-") as data:
        Path(data).chmod(0o755)  # as root, PostgreSQL's own user must reach it (pipeline.dev.embedded)
        servers = None
        if suite.servers:
            sys.path.insert(0, str(ROOT))
            from pipeline.dev.embedded import EmbeddedServers

            servers = EmbeddedServers(Path(data)).__enter__()
            env.update(TURNSTILE_DATABASE_URL=servers.postgres.url, TURNSTILE_NATS_URL=servers.nats.url)
        try:
            patterns = args.only or list(suite.functions)
            run = subprocess.run(
                [str(mutmut), "run", *patterns], cwd=work, env=env, stdout=subprocess.DEVNULL, check=False
            )
        finally:
            if servers is not None:
                servers.__exit__(None, None, None)
    results = subprocess.run(
        [str(mutmut), "results", "--all", "true"], cwd=work, env=env, capture_output=True, text=True
    ).stdout
    if run.returncode != 0:  # e.g. the suite's tests failed to collect in the copy: no score is a score
        raise SystemExit(f"mutmut run exited {run.returncode} in {work}: run `mutmut run` there to see why")
    counts, survivors = scores(results)
    (work / "survivors.txt").write_text("".join(f"{name}\n" for name in survivors))
    for module, outcomes in sorted(counts.items()):
        total, killed = sum(outcomes.values()), outcomes["killed"] + outcomes["timeout"]
        print(
            f"{module}: {killed} of {total} mutants killed ({killed / max(total, 1):.0%}), "
            f"{outcomes['survived']} survived, {outcomes['no tests']} reached by no test"
        )
    print(f"{args.suite}: {time.monotonic() - started:.0f} s; survivors in {work / 'survivors.txt'}")


if __name__ == "__main__":
    main()
