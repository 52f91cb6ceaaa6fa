#!/usr/bin/env bash
# The test suite against real containers, from a fresh Debian machine: the same set-up as the
# demo, then pytest (runc always; runsc too where gVisor is installed, and required when
# SANDKERNEL_REQUIRE_RUNSC=1, as CI sets it on machines that have it).
#
#   bash scripts/test.sh                 the whole suite (what CI runs)
#   bash scripts/test.sh --quick         the pure tier plus one smoke test of each door under runc
#   bash scripts/test.sh tests/test_x.py  any further arguments go to pytest
#
# The tests run on four parallel workers (pytest-xdist; SANDKERNEL_TEST_WORKERS=N to change it,
# 1 for a serial run in this process): most of a container test's time is spent waiting on a
# sandbox, so four workers share two cores well. tests/scheduling.py says how tests are grouped (a
# module's sandboxes on one worker, the Swarm lab's modules together, dockerd stops alone).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
quick=0
if [ "${1:-}" = "--quick" ]; then
  quick=1
  shift
fi
started=$SECONDS
source "$here/scripts/prepare.sh"
cd "$here"
ruff check .
set_up=$((SECONDS - started))

workers="${SANDKERNEL_TEST_WORKERS:-4}"
args=(--durations=40)  # the slowest tests, to keep CI well inside its time
if [ "$workers" -gt 1 ]; then
  args+=(-n "$workers" --dist loadgroup)
fi
if [ "$quick" = 1 ]; then
  args+=(-m "not docker or (smoke and not runsc)")
fi
status=0
python -m pytest "${args[@]}" "$@" || status=$?
# Sandboxes whose processes outlived what Docker knows of them (tests/leftovers.py) fail the run too.
python -m tests.leftovers || status=1
tested=$((SECONDS - started - set_up))
expected="under 35 min on 2 cores with 4 workers (tests/README.md)"
[ "$quick" = 1 ] && expected="under 5 min"
echo "[test] set-up ${set_up} s, tests ${tested} s, total $((SECONDS - started)) s; expected: ${expected}" >&2
exit "$status"
