#!/usr/bin/env bash
# Make this Debian machine ready for sandkernel: Docker engine (from the distribution),
# gVisor's runsc registered as a runtime, debootstrap for the offline base image, PostgreSQL, and
# the Python package itself. Idempotent: each step checks before it acts.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[host-setup] %s\n' "$*" >&2; }

as_root() { [ "$(id -u)" -eq 0 ] || { log "$1: run this script as root"; exit 1; }; }
apt_updated=0
apt_install() {  # apt_install PACKAGE...; returns apt-get's status
  export DEBIAN_FRONTEND=noninteractive
  [ "$apt_updated" = 1 ] || { apt-get update -q >/dev/null; apt_updated=1; }
  apt-get install -y -q --no-install-recommends "$@" >/dev/null
}

if ! command -v dockerd >/dev/null 2>&1; then
  as_root "the Docker engine is missing"; log "installing docker.io"; apt_install docker.io
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  as_root "debootstrap is missing"; log "installing debootstrap"; apt_install debootstrap
fi
# PostgreSQL, from the distribution: the cluster tests start throwaway servers from its binaries
# (tests/postgres_fixtures.py), and a cluster's catalog may run on it (--catalog-url).
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  as_root "PostgreSQL is missing"; log "installing postgresql"; apt_install postgresql
fi
# gVisor is optional for a user (without it runsc sessions are refused with a clear error) but not
# for CI: with SANDKERNEL_REQUIRE_RUNSC=1 (.ci/run sets it where gVisor can be had) any runsc
# problem stops this script; otherwise it is a loud warning, never a quiet line.
require_runsc="${SANDKERNEL_REQUIRE_RUNSC:-0}"
runsc_problem() {  # runsc_problem MESSAGE
  if [ "$require_runsc" = 1 ]; then
    log "ERROR: $1 (SANDKERNEL_REQUIRE_RUNSC=1 requires gVisor)"; exit 1
  fi
  log "WARNING: $1"
  log "WARNING: gVisor sessions will be refused and the runsc half of the tests skipped"
}
# The gVisor build: bookworm-backports' 2024 one, pinned. It checkpoints and restores a sandbox
# (issue 33: memory snapshots) where the default suite's 2022 build does not, and runs everything
# the older one ran. Debian's own archive carries it (the same mirror, another suite); where that
# suite cannot be had, the default suite's build is installed instead, with a warning.
RUNSC_VERSION="0.0~20240729.0-4~bpo12+2"
RUNSC_SUITE="bookworm-backports"
runsc_installed() { dpkg-query -W -f='${Version}' runsc 2>/dev/null || true; }
backports_source() {  # the suite beside the distribution's own, from the same mirror
  local mirror
  mirror=$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)\/\{0,1\}$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
  printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "${mirror:-http://deb.debian.org/debian}" "$RUNSC_SUITE"
}
if [ "$(runsc_installed)" != "$RUNSC_VERSION" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    if command -v runsc >/dev/null 2>&1; then
      log "WARNING: runsc $(runsc_installed) is not the pinned $RUNSC_VERSION (run this script as root to install it)"
    else
      runsc_problem "runsc (gVisor) is not installed and this script is not root to install it"
    fi
  elif [ "$(. /etc/os-release && echo "${VERSION_CODENAME:-}")" = bookworm ]; then
    backports_source > "/etc/apt/sources.list.d/sandkernel-$RUNSC_SUITE.sources"
    apt_updated=0  # the new suite's package lists
    log "installing runsc $RUNSC_VERSION (gVisor, from $RUNSC_SUITE)"
    if ! apt_install -t "$RUNSC_SUITE" "runsc=$RUNSC_VERSION"; then
      log "WARNING: runsc $RUNSC_VERSION could not be installed from $RUNSC_SUITE; memory snapshots need it"
      command -v runsc >/dev/null 2>&1 || apt_install runsc \
        || runsc_problem "installing runsc failed (apt-get install runsc, output above)"
    fi
  elif ! command -v runsc >/dev/null 2>&1; then
    log "installing runsc (gVisor)"
    apt_install runsc || runsc_problem "installing runsc failed (apt-get install runsc, output above)"
  fi
fi

# /etc/docker/daemon.json: live-restore, so restarting or upgrading dockerd leaves the sandboxes
# running (durable sessions survive it); and runsc: ptrace platform (never KVM: it hangs here), no
# network of its own, and --host-uds=all so the kernel's ZMQ ipc sockets appear in the bind-mounted
# runtime dir (create) and an allowlist session can reach its egress proxy socket (open).
runsc_registered() { docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"'; }
live_restore() { [ "$(docker info --format '{{.LiveRestoreEnabled}}' 2>/dev/null)" = true ]; }
# Docker runs runsc through sandkernel's wrapper (scripts/sandkernel-runsc): runsc itself, except
# that it restores a sandbox's memory image in place where the gateway asks for it (memory
# snapshots, docs/snapshots.md). Installed root-owned, outside this checkout.
RUNSC_WRAPPER=/usr/local/libexec/sandkernel/runsc
daemon_changed=unchanged
if [ "$(id -u)" -eq 0 ]; then
  runtime=""
  if command -v runsc >/dev/null 2>&1; then
    install -d -m 0755 "$(dirname "$RUNSC_WRAPPER")"
    sed "s|@RUNSC@|$(command -v runsc)|" "$here/scripts/sandkernel-runsc" > "$RUNSC_WRAPPER.new"
    chmod 0755 "$RUNSC_WRAPPER.new" && mv "$RUNSC_WRAPPER.new" "$RUNSC_WRAPPER"
    runtime=$RUNSC_WRAPPER
  fi
  daemon_changed=$(python3 "$here/scripts/docker_daemon_config.py" /etc/docker/daemon.json "$runtime")
fi

if ! docker info >/dev/null 2>&1; then
  as_root "the Docker engine is not running"
  log "starting dockerd (log: /var/log/dockerd.log)"
  nohup dockerd >>/var/log/dockerd.log 2>&1 &
  for _ in $(seq 1 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { log "dockerd did not start:"; tail -20 /var/log/dockerd.log >&2; exit 1; }
elif [ "$daemon_changed" = changed ]; then
  # SIGHUP re-reads daemon.json (runtimes and live-restore): the running containers are untouched.
  log "reloading dockerd (daemon.json changed)"; pkill -HUP -x dockerd || true
  for _ in $(seq 1 20); do live_restore && break; sleep 0.5; done
fi
if live_restore; then
  log "Docker live-restore is on: restarting dockerd leaves the sandboxes running"
else
  log "WARNING: Docker live-restore is off: restarting dockerd stops every sandbox (run this script as root)"
fi
if command -v runsc >/dev/null 2>&1; then
  if runsc_registered; then
    log "runsc is registered with Docker"
  else
    runsc_problem "runsc is installed but 'docker info' does not list it as a runtime (see /etc/docker/daemon.json)"
  fi
fi

# A virtualenv keeps us clear of the system Python (Debian marks it externally managed).
python="${PYTHON:-python3}"
if [ ! -x "$here/.venv/bin/python" ]; then
  log "creating $here/.venv"
  if ! "$python" -m venv "$here/.venv" 2>/dev/null; then
    [ "$(id -u)" -eq 0 ] && apt-get install -y -q python3-venv >/dev/null
    rm -rf "$here/.venv"; "$python" -m venv "$here/.venv"
  fi
fi
log "installing the sandkernel package into .venv"
"$here/.venv/bin/python" -m pip install -q --disable-pip-version-check -e "$here[test]" 2>&1 \
  | grep -v -e '^WARNING: Location' -e 'Running pip as the' || true
"$here/.venv/bin/python" -c "import sandkernel.kernels" \
  || { log "the package did not install; see pip's output above"; exit 1; }

# The Docker engine yields the CPU to executes: a CPU group of its own at a low weight (issue 30;
# kernels/sandbox/service_cpu.py says why). Never fails the set-up.
if [ "$(id -u)" -eq 0 ]; then
  log "$("$here/.venv/bin/python" -m sandkernel.kernels.sandbox.service_cpu)"
fi
