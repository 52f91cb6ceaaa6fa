#!/usr/bin/env bash
# Make this Debian machine ready for sandkernel: Docker engine (from the distribution),
# gVisor's runsc registered as a runtime, debootstrap for the offline base image, and
# the Python package itself. Idempotent: each step checks before it acts.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[host-setup] %s\n' "$*" >&2; }

need_apt=()
command -v dockerd >/dev/null 2>&1 || need_apt+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need_apt+=(debootstrap)
command -v runsc >/dev/null 2>&1 || need_apt+=(runsc)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    log "missing ${need_apt[*]}; run this script as root (or install them with apt-get)"; exit 1
  fi
  log "installing ${need_apt[*]} from the distribution's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  # runsc is optional: a distribution without it still gets a working runc setup.
  apt-get install -y -q --no-install-recommends "${need_apt[@]/runsc/}" >/dev/null
  if [[ " ${need_apt[*]} " == *" runsc "* ]]; then
    apt-get install -y -q --no-install-recommends runsc >/dev/null 2>&1 \
      || log "runsc is not available from apt here; gVisor sessions will be refused"
  fi
fi

# Register runsc (ptrace platform, no network of its own; host-uds=create lets the kernel's
# ZMQ ipc sockets appear in the bind-mounted runtime dir).
if command -v runsc >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
  python3 "$here/scripts/docker_daemon_config.py" /etc/docker/daemon.json "$(command -v runsc)"
fi

if ! docker info >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then log "the Docker engine is not running and only root can start it"; exit 1; fi
  log "starting dockerd"
  mkdir -p /var/log
  nohup dockerd >/var/log/dockerd.log 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { log "dockerd did not start; see /var/log/dockerd.log"; tail -20 /var/log/dockerd.log >&2; exit 1; }
elif [ "${SANDKERNEL_RELOAD_DOCKER:-0}" = 1 ]; then
  pkill -HUP dockerd || true
fi

log "installing the sandkernel package"
python3 -m pip install -q -e "$here[test]"
