#!/bin/bash
# Runs the pytest-free check in test_fizzbuzz.py; its exit status is the verdict.
here="$(dirname "$0")"
if python3 "$here/test_fizzbuzz.py"; then reward=1; else reward=0; fi
echo "$reward" > "${TURNSTILE_SANDBOX_ROOT:-}/logs/verifier/reward.txt"
