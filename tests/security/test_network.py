"""Network from inside the sandbox: nothing beyond its own loopback. Connections are aimed only
at listeners this test starts on the host's loopback (TCP, UDP, an abstract unix socket) and at
the gateway's own port; the listeners must see nothing. No external or private address is ever
contacted: the absence of routes is asserted structurally."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest

pytestmark = [pytest.mark.security, pytest.mark.docker]


class HostListeners:
    """TCP and UDP on 127.0.0.1 and an abstract unix socket, counting whatever reaches them."""

    def __init__(self) -> None:
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen()
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.abstract_name = f"sandkernel-test-{id(self)}"
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind("\0" + self.abstract_name)
        self.unix.listen()
        self.hits: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._accept, args=(s, n), daemon=True)
            for s, n in ((self.tcp, "tcp"), (self.unix, "unix"))
        ] + [threading.Thread(target=self._receive, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _accept(self, sock: socket.socket, name: str) -> None:
        sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            self.hits.append(name)
            conn.close()

    def _receive(self) -> None:
        self.udp.settimeout(0.2)
        while not self._stop.is_set():
            try:
                self.udp.recv(100)
            except OSError:
                continue
            self.hits.append("udp")

    def close(self) -> list[str]:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        for sock in (self.tcp, self.udp, self.unix):
            sock.close()
        return self.hits


@pytest.fixture
def listeners():
    found = HostListeners()
    yield found
    found.close()


async def test_only_loopback_and_no_routes(arena):
    found = await arena.probe(
        """import json, socket
routes = [l.split()[:2] for l in open('/proc/net/route').read().splitlines()[1:]]
v6 = [l.split()[-1] for l in open('/proc/net/ipv6_route').read().splitlines()] if __import__('os').path.exists('/proc/net/ipv6_route') else []
print(json.dumps({'ifaces': [n for _, n in socket.if_nameindex()], 'routes': routes, 'v6_devices': sorted(set(v6))}))"""
    )
    assert found["ifaces"] == ["lo"] and found["routes"] == []
    assert set(found["v6_devices"]) <= {"lo"}


async def test_host_loopback_services_are_unreachable(arena, listeners):
    tcp_port = listeners.tcp.getsockname()[1]
    udp_port = listeners.udp.getsockname()[1]
    found = await arena.probe(
        f"""import errno, json, socket
out = {{}}
for name, port in [('test_listener', {tcp_port}), ('gateway', {arena.gateway.port})]:
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect(('127.0.0.1', port)); out[name] = 'connected'
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e))
    s.close()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(5):
    u.sendto(b'hello', ('127.0.0.1', {udp_port}))
a = socket.socket(socket.AF_UNIX); a.settimeout(3)
try:
    a.connect('\\0{listeners.abstract_name}'); out['abstract_unix'] = 'connected'
except OSError as e:
    out['abstract_unix'] = errno.errorcode.get(e.errno, str(e))
print(json.dumps(out))"""
    )
    assert found == {"test_listener": "ECONNREFUSED", "gateway": "ECONNREFUSED", "abstract_unix": "ECONNREFUSED"}
    await asyncio.sleep(0.5)
    assert listeners.hits == [], f"a host listener was reached: {listeners.hits}"


def host_addresses() -> list[str]:
    """This host's own IPv4 addresses beyond loopback (the docker bridge gateway included), from
    the kernel's local routing table: traffic aimed at them never leaves the machine."""
    lines = Path("/proc/net/fib_trie").read_text().splitlines()
    found = {lines[i - 1].split()[-1] for i, line in enumerate(lines) if "/32 host LOCAL" in line and i > 0}
    return sorted(a for a in found if not a.startswith("127."))


# The one answer to "send anywhere but loopback": Linux has no route (only lo, no routes);
# gVisor's netstack, holding only its loopback, answers that the host is unreachable.
UNREACHABLE = {"runc": "ENETUNREACH", "runsc": "EHOSTUNREACH"}


async def test_no_resolver_and_no_host_address_is_reachable(arena):
    """No name can be resolved because no resolver can be reached: the nameservers the
    sandbox's resolv.conf names have no route (a UDP connect() is a route lookup that sends
    nothing, so an address off this machine is never contacted), and neither have this host's
    own addresses (the docker bridge gateway, its real interfaces), by UDP or TCP."""
    own = host_addresses()
    assert own, "this host should have an address beyond loopback (at least docker0's)"
    found = await arena.probe(
        f"""import errno, json, socket
def attempt(fn):
    try:
        fn(); return 'reached'
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
def udp_connect(addr):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 53))
def udp_send(addr):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b'x', (addr, 53))
def tcp_connect(addr):
    with socket.socket() as s:
        s.settimeout(5); s.connect((addr, 53))
conf = open('/etc/resolv.conf').read() if __import__('os').path.exists('/etc/resolv.conf') else ''
nameservers = [l.split()[1] for l in conf.splitlines() if l.startswith('nameserver')]
out = {{'nameservers': {{a: attempt(lambda a=a: udp_connect(a)) for a in nameservers}},
       'host': {{a: [attempt(lambda a=a: f(a)) for f in (udp_connect, udp_send, tcp_connect)] for a in {own!r}}}}}
print(json.dumps(out))"""
    )
    unreachable = UNREACHABLE[arena.runtime]
    loopback = [a for a in found["nameservers"] if a.startswith("127.")]
    assert not loopback, f"a loopback nameserver would need its own proof: {found}"
    assert set(found["nameservers"].values()) <= {unreachable}, found
    assert found["host"] == {a: [unreachable] * 3 for a in own}, found


async def test_raw_packet_and_netlink_writes_are_refused(arena):
    """Raw IP and packet sockets need CAP_NET_RAW: EPERM. A well-formed RTM_NEWADDR (an address
    with IFA_LOCAL and IFA_ADDRESS on lo) needs CAP_NET_ADMIN: Linux acks it with EPERM, gVisor's
    netlink with EACCES (gVisor 2022-12, measured)."""
    found = await arena.probe(
        """import errno, json, socket, struct
out = {}
for name, args in [('raw_icmp', (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)),
                   ('packet', (socket.AF_PACKET, socket.SOCK_RAW, 0))]:
    try:
        socket.socket(*args).close(); out[name] = 'succeeded'
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e))
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0); s.bind((0, 0))
addr = socket.inet_aton('10.254.254.254')
attrs = struct.pack('=HH4s', 8, 2, addr) + struct.pack('=HH4s', 8, 1, addr)  # IFA_LOCAL, IFA_ADDRESS
body = struct.pack('=BBBBI', socket.AF_INET, 32, 0, 0, socket.if_nametoindex('lo')) + attrs
# RTM_NEWADDR with NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
s.send(struct.pack('=LHHLL', 16 + len(body), 20, 0x1 | 0x4 | 0x400 | 0x200, 1, 0) + body)
code = struct.unpack('=i', s.recv(4096)[16:20])[0]
out['netlink_route_write'] = errno.errorcode.get(-code, str(code)) if code else 'succeeded'
print(json.dumps(out))"""
    )
    netlink = "EPERM" if arena.runtime == "runc" else "EACCES"
    assert found == {"raw_icmp": "EPERM", "packet": "EPERM", "netlink_route_write": netlink}, found
