#!/usr/bin/env bash
# The main job, from a fresh Debian machine: install what is missing (Docker engine, gVisor,
# debootstrap, the package), build the kernel image, then run a sandboxed session doing real
# data work. Leaves sandkernel-demo.ipynb in the current directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$here/scripts/prepare.sh"
sandkernel demo --notebook "${DEMO_NOTEBOOK:-sandkernel-demo.ipynb}" "$@"
