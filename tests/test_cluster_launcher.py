"""The cluster launcher learns that its gateway container ended from the engine, at once.

``gateway/cluster/launcher.py`` waits in ``POST /containers/<id>/wait`` on a thread of its own
(:func:`_watch_exit`) instead of inspecting the container every second: these tests run that
watcher against real containers on the local engine (the whole launcher is a Swarm task; its
plan and secrets are tested in tests/test_cluster_deploy.py).
"""

from __future__ import annotations

import queue
import threading
import uuid

import docker
import pytest

from sandkernel.gateway.cluster.launcher import _watch_exit
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, owner_label

pytestmark = pytest.mark.docker

IMAGE = "sandkernel-kernel:0.1.0"
# Exits with 3 on SIGTERM and waits for it otherwise, the way a gateway stops on `docker stop`.
EXIT_ON_TERM = "import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(3)); signal.pause()"


@pytest.fixture
def nothing_left():
    """A docker client, the label that finds this test's containers and the labels to give them;
    fails if the test left one. The labels name this process as the owner: another worker's
    gateway, starting meanwhile, reaps a session-labelled container whose owner is not alive
    (one without an owner label was removed under this test in a parallel run)."""
    client = docker.from_env()
    label = f"sandkernel.session=launcher-test-{uuid.uuid4().hex[:12]}"
    key, value = label.split("=")
    yield client, label, {key: value, OWNER_LABEL: owner_label()}
    left = client.containers.list(all=True, filters={"label": label})
    for container in left:
        container.remove(force=True)
    client.close()
    assert not left, f"the test left containers behind: {[c.short_id for c in left]}"


def _watch(container) -> tuple[queue.SimpleQueue, threading.Thread]:
    events: queue.SimpleQueue = queue.SimpleQueue()
    thread = threading.Thread(target=_watch_exit, args=(container, events), daemon=True)
    thread.start()
    return events, thread


def test_the_watcher_waits_while_the_gateway_runs_and_reports_its_exit_code(nothing_left):
    client, _, labels = nothing_left
    container = client.containers.run(
        IMAGE, ["-c", EXIT_ON_TERM], entrypoint="python3", network_mode="none", labels=labels, detach=True
    )
    try:
        events, thread = _watch(container)
        # The wait request is in the engine and the container runs: nothing to report, no polling.
        thread.join(timeout=0.5)
        assert thread.is_alive() and events.empty()
        container.kill(signal="SIGTERM")
        assert events.get(timeout=30) == ("exited", 3)
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        container.remove(force=True)


def test_a_gateway_container_removed_by_someone_else_is_reported_as_removed(nothing_left):
    client, _, labels = nothing_left
    container = client.containers.create(IMAGE, entrypoint="true", network_mode="none", labels=labels)
    container.remove(force=True)
    events, _ = _watch(container)
    assert events.get(timeout=30) == ("removed", None)
