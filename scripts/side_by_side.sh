#!/usr/bin/env bash
# Runs several commands at once and fails if any fails: the last in the foreground, the output
# of each other one held back and shown after the last's, in the order given, so that none
# interleave.
# `make test` runs vLLM's tests beside the integration tier this way: the process-starting tests
# mostly wait (for workers to start, for what crosses processes), and one run at a time left the
# machine's two cores idle for most of theirs. (`make check`'s tests run before them, not beside:
# docs/decisions/2026-12-07-test-runs-at-once.md.)
# Usage: scripts/side_by_side.sh "command" ["command" ...] "foreground command"
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 command [command ...]" >&2
  exit 2
fi
held=()
commands=()
pids=()
trap 'rm -f "${held[@]}"' EXIT
while [ $# -gt 1 ]; do
  out=$(mktemp)
  held+=("$out")
  bash -c "$1" >"$out" 2>&1 &
  pids+=($!)
  commands+=("$1")
  shift
done
bash -c "$1"
status=$?
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || status=1
  echo
  echo "---- ${commands[$i]} ----"
  cat "${held[$i]}"
done
exit $status
