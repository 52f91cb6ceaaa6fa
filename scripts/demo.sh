#!/usr/bin/env bash
# The main job, from a fresh Debian machine: install what is missing (Docker engine, gVisor,
# debootstrap, the package), build the kernel image, then an agent analyses a sales CSV in a
# sandbox (Claude with ANTHROPIC_API_KEY, else a scripted offline conversation; the code runs for
# real either way). Leaves sandkernel-demo.ipynb and sandkernel-demo/report.png here.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$here/scripts/prepare.sh"
sandkernel demo --notebook "${DEMO_NOTEBOOK:-sandkernel-demo.ipynb}" "$@"
