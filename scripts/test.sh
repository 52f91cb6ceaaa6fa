#!/usr/bin/env bash
# The whole test suite against real containers, from a fresh Debian machine: the same set-up
# as the demo, then pytest (runc always; runsc too where gVisor is installed, and required
# when SANDKERNEL_REQUIRE_RUNSC=1, as CI sets it on machines that have it).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$here/scripts/prepare.sh"
cd "$here"
ruff check .
python -m pytest --durations=40 "$@"  # the slowest tests, to keep CI well inside its time
