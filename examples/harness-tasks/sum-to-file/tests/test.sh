#!/bin/bash
# reward.json: the verdict and a partial score (a number that is close gets 0.5: the verifier's own scale).
answer="$(tr -d '[:space:]' < sum.txt 2>/dev/null)"
case "$answer" in
    5050) reward=1 ;;
    50[0-9][0-9]) reward=0.5 ;;
    *) reward=0 ;;
esac
printf '{"reward": %s}\n' "$reward" > "${TURNSTILE_SANDBOX_ROOT:-}/logs/verifier/reward.json"
