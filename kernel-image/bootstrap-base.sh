#!/usr/bin/env bash
# Build a minimal Debian base image with no registry: debootstrap a root filesystem from the
# distribution's mirror and `docker import` it. Used when `python:3.11-slim` cannot be pulled.
# Usage: bootstrap-base.sh TAG [SUITE] [MIRROR]
set -euo pipefail
tag="$1"; suite="${2:-bookworm}"; mirror="${3:-http://deb.debian.org/debian}"
packages=python3,python3-venv,catatonit,ca-certificates,procps
root="$(mktemp -d /var/tmp/sandkernel-rootfs.XXXXXX)"
trap 'rm -rf "$root"' EXIT
echo "[base] debootstrap $suite ($packages) from $mirror"
debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" \
  | grep -E '^I: (Retrieving|Validating|Extracting|Installing|Configuring) ' | awk 'NR % 25 == 1' || true
test -x "$root/usr/bin/python3" || { echo "[base] debootstrap failed: no python3 in rootfs" >&2; exit 1; }
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
echo "[base] importing as $tag"
tar -C "$root" -c . | docker import --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
echo "[base] done: $tag"
