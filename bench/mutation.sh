#!/usr/bin/env bash
# Mutation testing of the rules whose tests need no server (the append rules both stores share, the
# trajectory math): mutmut changes one thing at a time ([tool.mutmut] in pyproject.toml names the modules
# and the tests) and counts the mutants no test kills. Prints the score per module; about 2 minutes here.
# Not run by CI. Needs `pip install -e '.[mutation]'`; `.venv/bin/mutmut show NAME` shows a survivor.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf mutants
.venv/bin/mutmut run > /dev/null 2>&1 || true
.venv/bin/mutmut results --all true > mutants/results.txt 2>/dev/null
.venv/bin/python - <<'PY'
import collections
import re
from pathlib import Path

counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
for line in Path("mutants/results.txt").read_text().splitlines():
    found = re.match(r"\s*([\w.]+)\.x\S*__mutmut_\d+: (\w+)", line)
    if found:
        counts[found[1]][found[2]] += 1
for module, outcomes in sorted(counts.items()):
    total, killed = sum(outcomes.values()), outcomes["killed"]
    print(f"{module}: {killed} of {total} mutants killed ({killed / total:.0%}), {outcomes['survived']} survived")
PY
