"""The swarm lab (tests/cluster): three Docker engines on this machine form a Swarm, each in its
own network namespace, with no way out of the lab, and nothing left once it is torn down.

The lab is what the cluster tests of issue 18 deploy the gateway stack on; these tests prove the
lab itself: the nodes and their labels, scheduling on every node and only on gVisor hosts when
constrained, engines that do not see each other's containers, an overlay network between the
hosts, no route out, the test process reaching every host, and a teardown that leaves nothing.
Host 3 is deliberately left without gVisor, as a cluster may have such hosts.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from .cluster import BASE_IMAGE, LAB_NET, RUNSC_LABEL, SWITCH_NET, Lab, LabError, main_runtimes
from .cluster.fixtures import swarm_lab_fixture  # noqa: F401  (the swarm_lab fixture)

# The Swarm lab's namespaces and addresses are one per machine: its modules run one after another.
pytestmark = [pytest.mark.docker, pytest.mark.xdist_group("swarm-lab")]
SWARM_LAB = {"runsc_hosts": (1, 2) if "runsc" in main_runtimes() else ()}
OUTSIDE = "203.0.113.1"  # TEST-NET-3: never routed anywhere. (Not 192.0.2.1: this machine's own uplink is 192.0.2.0/24.)
# The source address a container would use for OUTSIDE: a UDP connect() only looks the route up, sending nothing.
SOURCE_PROBE = f"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(({OUTSIDE!r}, 80))
print(s.getsockname()[0])
"""


# Answers GET with the container's hostname (its short container id).
HOSTNAME_SERVER = """
import http.server, socket
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(socket.gethostname().encode())
http.server.HTTPServer(("", 8000), Handler).serve_forever()
"""


NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to the lab, whatever *_proxy says


def http_get(url: str, timeout: float = 30.0) -> str:
    """GET ``url`` from the test process, retrying until the server listens (a task is Running
    before its process has bound the port)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with NO_PROXY.open(url, timeout=5) as response:
                return response.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def unique(what: str) -> str:
    return f"sklab-test-{what}-{uuid.uuid4().hex[:6]}"


def test_a_second_lab_waits_for_the_machine_wide_lock_and_touches_nothing() -> None:
    """First in the module (before the lab fixture is up): another process's lab is simulated by
    holding the lock; up() must time out on it, not tear that lab down as a crashed run's."""
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.bind("\0sklab.lab-lock")
    before = Lab().leftovers()  # normally empty; whatever a crashed run left must stay as it was
    try:
        with pytest.raises(LabError, match="lab lock"):
            Lab(lock_timeout=1.0).up()
        assert Lab().leftovers() == before
        assert Lab._active is None
    finally:
        holder.close()


def test_three_ready_nodes_named_after_their_hosts_all_managers(swarm_lab: Lab) -> None:
    nodes = {n["Hostname"]: n for n in swarm_lab.nodes()}
    assert sorted(nodes) == ["sklab-h1", "sklab-h2", "sklab-h3"]
    assert {n["Status"] for n in nodes.values()} == {"Ready"}
    assert {n["Availability"] for n in nodes.values()} == {"Active"}
    assert sorted(n["ManagerStatus"] for n in nodes.values()) == ["Leader", "Reachable", "Reachable"]


def test_engines_are_separate_and_the_main_engine_is_untouched(swarm_lab: Lab) -> None:
    name = unique("only-on-h2")
    swarm_lab.docker(2, "run", "-d", "--name", name, "--network", "none", BASE_IMAGE, "sleep", "300")
    try:
        assert name in swarm_lab.docker(2, "ps", "--format", "{{.Names}}").stdout.split()
        # Its containerd shim's socket is in the engine's private /run/containerd, not the machine's.
        assert list((swarm_lab.host(2).exec_root / "run-containerd" / "s").iterdir())
        for other in (1, 3):
            assert name not in swarm_lab.docker(other, "ps", "-a", "--format", "{{.Names}}").stdout
        main = subprocess.run(["docker", "ps", "-a", "--filter", f"name={name}", "--format", "{{.Names}}"],
                              capture_output=True, text=True, check=True)
        assert main.stdout.strip() == ""
    finally:
        swarm_lab.docker(2, "rm", "-f", name)
    infos = [json.loads(swarm_lab.docker(h, "info", "--format", "{{json .}}").stdout) for h in (1, 2, 3)]
    assert [i["DockerRootDir"] for i in infos] == [str(h.data_root) for h in swarm_lab.hosts]
    assert [i["Name"] for i in infos] == ["sklab-h1", "sklab-h2", "sklab-h3"]
    assert len({i["ID"] for i in infos}) == 3  # each its own /etc/docker/key.json, not the main engine's
    main_swarm = subprocess.run(["docker", "info", "--format", "{{.Swarm.LocalNodeState}}"],
                                capture_output=True, text=True, check=True).stdout.strip()
    assert main_swarm == "inactive"


def test_a_global_service_runs_one_task_on_every_node_reachable_on_its_host_port(swarm_lab: Lab) -> None:
    """What the gateway stack will do: a global service publishing its port in host mode (the
    ingress routing mesh and VIPs need IPVS, which this machine's kernel lacks), answered on each
    host's lab address by that host's own task."""
    name = unique("global")
    swarm_lab.docker(1, "service", "create", "--detach", "--quiet", "--no-resolve-image", "--name", name,
                     "--mode", "global", "--publish", "mode=host,target=8000,published=18080",
                     BASE_IMAGE, "python3", "-c", HOSTNAME_SERVER)
    try:
        assert swarm_lab.wait_running(name, 3) == ["sklab-h1", "sklab-h2", "sklab-h3"]
        answers = {}
        for h in swarm_lab.hosts:
            task = swarm_lab.docker(h, "ps", "--filter", f"label=com.docker.swarm.service.name={name}",
                                    "--format", "{{.ID}}").stdout.strip()
            answers[h.name] = (http_get(f"http://{h.ip}:18080/"), task)
        assert all(answer and task.startswith(answer) for answer, task in answers.values()), answers
    finally:
        swarm_lab.docker(1, "service", "rm", name)


def test_runsc_label_places_gvisor_services_on_gvisor_hosts_only(swarm_lab: Lab) -> None:
    if "runsc" not in main_runtimes():
        pytest.skip("gVisor (runsc) is not registered with the main engine, so no lab host has it")
    assert [swarm_lab.node_labels(h) for h in (1, 2, 3)] == [{RUNSC_LABEL: "true"}, {RUNSC_LABEL: "true"}, {}]
    name = unique("runsc")
    swarm_lab.docker(1, "service", "create", "--detach", "--quiet", "--no-resolve-image", "--name", name,
                     "--mode", "global", "--constraint", f"node.labels.{RUNSC_LABEL}==true",
                     BASE_IMAGE, "sleep", "infinity")
    try:
        assert swarm_lab.wait_running(name, 2) == ["sklab-h1", "sklab-h2"]
        assert [node for node, _ in swarm_lab.service_tasks(name)] == ["sklab-h1", "sklab-h2"]
    finally:
        swarm_lab.docker(1, "service", "rm", name)
    # The label tells the truth: host 1 runs gVisor as the main engine does, host 3 refuses it.
    kernel = swarm_lab.docker(1, "run", "--rm", "--runtime", "runsc", "--network", "none", BASE_IMAGE, "uname", "-r",
                              timeout=120).stdout.strip()
    assert kernel and kernel != os.uname().release  # gVisor's own kernel version, not the machine's
    refused = swarm_lab.docker(3, "run", "--rm", "--runtime", "runsc", BASE_IMAGE, "true", check=False)
    assert refused.returncode != 0 and "runsc" in refused.stderr


def test_an_overlay_network_spans_the_hosts(swarm_lab: Lab) -> None:
    net, server = unique("net"), unique("srv")
    swarm_lab.docker(1, "network", "create", "--driver", "overlay", "--attachable", net)
    try:
        swarm_lab.docker(1, "run", "-d", "--name", server, "--network", net, BASE_IMAGE, "python3", "-c",
                         "import socket\ns = socket.create_server(('', 8000))\n"
                         "while True:\n    c, _ = s.accept(); c.sendall(b'hello from h1'); c.close()")
        client = ("import socket, time\nfor _ in range(100):\n    try:\n"
                  f"        print(socket.create_connection(({server!r}, 8000), timeout=2).recv(100).decode()); break\n"
                  "    except OSError:\n        time.sleep(0.1)\n")
        out = swarm_lab.docker(2, "run", "--rm", "--network", net, BASE_IMAGE, "python3", "-c", client).stdout
        assert out.strip() == "hello from h1"
    finally:
        swarm_lab.docker(1, "rm", "-f", server, check=False)
        swarm_lab.docker(1, "network", "rm", net, check=False)


def routes(lab: Lab, host: int, family: str) -> list[str]:
    """Destinations of every route of a lab host's namespace, in every table but the kernel's
    ``local`` one (the host's own addresses), as ``ip`` prints them ("default", "10.213.0.0/24")."""
    shown = json.loads(lab.in_netns(host, "ip", "-j", family, "route", "show", "table", "all").stdout)
    return [r["dst"] for r in shown if r.get("table") != "local"]


def test_no_route_leaves_the_lab(swarm_lab: Lab) -> None:
    for h in swarm_lab.hosts:
        v4 = routes(swarm_lab, h.index, "-4")
        assert str(SWITCH_NET) in v4
        assert "default" not in v4 and all(LAB_NET.supernet_of(ipaddress.ip_network(dst)) for dst in v4), v4
        v6 = routes(swarm_lab, h.index, "-6")  # link-local and multicast only
        assert "default" not in v6 and all(ipaddress.ip_network(d).is_link_local or ipaddress.ip_network(d).is_multicast
                                           for d in v6), v6
        # The kernel's route lookup for OUTSIDE fails (a lookup, not a packet: nothing is sent).
        lookup = swarm_lab.in_netns(h, "ip", "route", "get", OUTSIDE, check=False)
        assert lookup.returncode != 0 and "Network is unreachable" in lookup.stderr, lookup
    # A container on a lab engine (default bridge, NATed by its host) gets no further than its host:
    # its route to OUTSIDE is its default one, through the bridge's gateway on its host, and the host
    # finds no route for a packet from it arriving on that bridge (`ip route get ... iif`: a lookup).
    name = unique("no-route")
    swarm_lab.docker(1, "run", "-d", "--name", name, BASE_IMAGE, "sleep", "300")
    try:
        source = swarm_lab.docker(1, "exec", name, "python3", "-c", SOURCE_PROBE).stdout.strip()
        settings = json.loads(swarm_lab.docker(1, "inspect", name).stdout)[0]["NetworkSettings"]
        bridge = json.loads(swarm_lab.docker(1, "network", "inspect", "bridge").stdout)[0]
        assert source == settings["IPAddress"] and settings["Gateway"] == bridge["IPAM"]["Config"][0]["Gateway"]
        device = bridge["Options"]["com.docker.network.bridge.name"]
        lookup = swarm_lab.in_netns(1, "ip", "route", "get", OUTSIDE, "from", source, "iif", device, check=False)
        assert lookup.returncode != 0 and "Network is unreachable" in lookup.stderr, lookup
        # (The same lookup toward another lab host is routed: it is OUTSIDE that has no route.)
        swarm_lab.in_netns(1, "ip", "route", "get", swarm_lab.ip_of(2), "from", source, "iif", device)
    finally:
        swarm_lab.docker(1, "rm", "-f", name, check=False)
    # The root namespace: one connected route to the lab's LAN, and nothing from the lab is forwarded.
    root = json.loads(subprocess.run(["ip", "-j", "route", "show", "dev", swarm_lab.root_veth], capture_output=True,
                                     text=True, check=True).stdout)
    assert [r["dst"] for r in root] == [str(SWITCH_NET)]
    with open(f"/proc/sys/net/ipv4/conf/{swarm_lab.root_veth}/forwarding") as f:
        assert f.read().strip() == "0"


def test_the_test_process_reaches_every_host(swarm_lab: Lab) -> None:
    for h in swarm_lab.hosts:  # the swarm's own port, published on the lab address of each host
        with socket.create_connection((swarm_lab.ip_of(h.index), 2377), timeout=5):
            pass


def test_a_killed_host_stops_answering_and_the_swarm_keeps_its_quorum(swarm_lab: Lab) -> None:
    """Second to last (it breaks host 3): kill_host() is how the cluster tests stop a host."""
    swarm_lab.docker(3, "run", "-d", "--network", "none", BASE_IMAGE, "sleep", "300")
    swarm_lab.kill_host(3)
    assert swarm_lab.docker(3, "version", check=False, timeout=10).returncode != 0
    probe = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], 2377), timeout=2)\n"
             "    print('answered')\nexcept OSError as e:\n    print('no answer', e)\n")
    assert swarm_lab.in_netns(1, sys.executable, "-c", probe, swarm_lab.ip_of(3)).stdout.startswith("no answer")
    # Hosts 1 and 2 carry on, and 2 managers of 3 still make a quorum: the swarm still answers.
    assert len(swarm_lab.nodes()) == 3
    assert swarm_lab.docker(2, "node", "ls", "--format", "{{.Hostname}}").returncode == 0


def test_teardown_leaves_nothing(swarm_lab: Lab) -> None:
    """Last in the module: takes the lab down itself (the fixture's down() after it is a no-op)."""
    pids = {h.index: int((h.exec_root / "dockerd.pid").read_text()) for h in swarm_lab.hosts}
    started = time.monotonic()
    swarm_lab.down()
    print(f"\nswarm lab timings (s): {json.dumps({k: round(v, 2) for k, v in swarm_lab.timings.items()})}"
          f" (teardown measured here: {time.monotonic() - started:.2f})")
    assert swarm_lab.leftovers() == []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert "sklab" not in netns
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert swarm_lab.lab_pids() == set()
    assert swarm_lab.lab_mounts() == []
    with open("/proc/self/mountinfo") as f:
        assert "sklab" not in f.read()
    # (No connect to a lab address here: without the lab's route it would take the default route out.)
