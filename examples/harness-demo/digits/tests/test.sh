#!/bin/bash
# The reward is the share of digits among the characters of the agent's final reply (answer.txt, written by
# `harness_shell_agent.py --answer answer.txt`), 0 without one: a partial score a randomly initialised model
# earns a little of by chance, and a policy learns to earn more of.
python3 - > "${TURNSTILE_SANDBOX_ROOT:-}/logs/verifier/reward.txt" <<'PYTHON'
from pathlib import Path

answer = Path("answer.txt").read_text(errors="replace") if Path("answer.txt").is_file() else ""
print(sum(c.isdigit() for c in answer) / len(answer) if answer else 0.0)
PYTHON
