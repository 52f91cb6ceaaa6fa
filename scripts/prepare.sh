# Sourced by demo.sh and test.sh: host set-up, a virtualenv with the package, the kernel image.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/scripts/host-setup.sh"
# shellcheck disable=SC1091
source "$here/.venv/bin/activate"
sandkernel --log-level INFO image build
sandkernel kernelspec install >/dev/null
