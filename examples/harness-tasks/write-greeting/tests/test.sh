#!/bin/bash
# Reward 1 if greeting.txt holds exactly $EXPECTED (from task.toml's [verifier] env), else 0.
# TURNSTILE_SANDBOX_ROOT is empty where the sandbox has a file system of its own (Harbor's /logs/verifier).
reward="${TURNSTILE_SANDBOX_ROOT:-}/logs/verifier/reward.txt"
if [ "$(cat greeting.txt 2>/dev/null)" = "$EXPECTED" ]; then echo 1 > "$reward"; else echo 0 > "$reward"; fi
