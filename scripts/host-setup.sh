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
if ! command -v runsc >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    runsc_problem "runsc (gVisor) is not installed and this script is not root to install it"
  else
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
daemon_changed=unchanged
if [ "$(id -u)" -eq 0 ]; then
  daemon_changed=$(python3 "$here/scripts/docker_daemon_config.py" /etc/docker/daemon.json \
    "$(command -v runsc || true)")
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
