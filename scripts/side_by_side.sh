#!/usr/bin/env bash
# Runs two commands at once and fails if either fails: the second in the foreground, the
# first's output held back and shown after the second's, so the two never interleave.
# `make test` runs vLLM's tests beside the platform's other process-starting tests: each mostly
# waits (for engines to start, for what crosses processes), and one at a time left one of the
# machine's two cores idle. (`make check`'s tests run before them, not beside:
# docs/decisions/2026-12-07-test-runs-at-once.md.)
# Usage: scripts/side_by_side.sh "first command" "second command"
set -uo pipefail
held=$(mktemp)
trap 'rm -f "$held"' EXIT
bash -c "$1" >"$held" 2>&1 &
first=$!
bash -c "$2"
second=$?
wait "$first"
first_status=$?
echo
echo "---- $1 ----"
cat "$held"
exit $((first_status || second))
