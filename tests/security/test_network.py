"""Network from inside the sandbox: nothing beyond its own loopback. Connections are aimed only
at listeners this test starts on the host's loopback (TCP, UDP, an abstract unix socket) and at
the gateway's own port; the listeners must see nothing. No external or private address is ever
contacted: the absence of routes is asserted structurally."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

pytestmark = pytest.mark.security


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


async def test_dns_fails_and_raw_sockets_are_refused(arena):
    found = await arena.probe(
        """import errno, json, socket
out = {}
try:
    socket.getaddrinfo('sandkernel-dns-probe.invalid', 80); out['dns'] = 'resolved'
except socket.gaierror as e:
    out['dns'] = 'gaierror'
for name, args in [('raw_icmp', (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)),
                   ('packet', (socket.AF_PACKET, socket.SOCK_RAW, 0)),
                   ('netlink_route_write', None)]:
    try:
        if args is None:
            s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0); s.bind((0, 0))
            # RTM_NEWADDR needs CAP_NET_ADMIN: ask the kernel for an address on lo and see it refused
            import struct
            msg = struct.pack('=LHHLL', 16 + 8, 20, 0x5, 1, 0) + struct.pack('BBBBI', 2, 8, 0, 0, 1)
            s.send(msg); reply = s.recv(4096)
            code = struct.unpack('=i', reply[16:20])[0]
            out[name] = errno.errorcode.get(-code, str(code)) if code else 'succeeded'
        else:
            socket.socket(*args); out[name] = 'succeeded'
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e))
print(json.dumps(out))"""
    )
    assert found["dns"] == "gaierror"
    assert found["raw_icmp"] in ("EPERM", "EACCES") and found["packet"] in ("EPERM", "EACCES", "EAFNOSUPPORT")
    assert found["netlink_route_write"] in ("EPERM", "EACCES", "EOPNOTSUPP", "EAFNOSUPPORT", "EINVAL"), found
