"""Controlled egress: default deny, an allowlist enforced by a proxy outside the sandbox, every
request audited. Upstreams are servers this test starts on loopback (explicitly allowed by the
policy); the one exception is the package-index test, which reaches only the index this
machine's pip already uses."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import tempfile
from pathlib import Path

import nbformat
import pytest

from sandkernel.errors import ConfigError
from sandkernel.kernels.egress.policy import EgressNotPermitted, EgressPolicy
from sandkernel.kernels.egress.proxy import EgressProxy

from .conftest import RUNTIME_PARAMS, require_runtime
from .gateway_fixtures import running_gateway, start_gateway, stop_gateway


class Upstream:
    """An HTTP server and a raw TCP echo on loopback that count every connection and keep what
    they were sent."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []

    async def start(self, host: str = "127.0.0.1") -> Upstream:
        self.http = await asyncio.start_server(self._http, host, 0)
        self.echo = await asyncio.start_server(self._echo, host, 0)
        self.http_port = self.http.sockets[0].getsockname()[1]
        self.echo_port = self.echo.sockets[0].getsockname()[1]
        return self

    async def _http(self, reader, writer):
        self.connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        self.requests.append(head)
        body = b"hello from upstream"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    async def _echo(self, reader, writer):
        self.connections += 1
        data = await reader.read(100)
        writer.write(b"echo:" + data)
        await writer.drain()
        writer.close()

    def close(self) -> None:
        self.http.close()
        self.echo.close()


def policy_for(upstream: Upstream, **extra) -> dict:
    return {
        "allow": ["allowed.test", "*.allowed.test", "private.test"],
        "ports": [upstream.http_port, upstream.echo_port],
        "resolve": {"allowed.test": "127.0.0.1", "api.allowed.test": "127.0.0.1", "private.test": "127.0.0.2"},
        "allow_addresses": ["127.0.0.1/32"],
        **extra,
    }


async def ask(proxy: EgressProxy, raw: bytes) -> bytes:
    """One request through the proxy's socket; returns once its audit record exists."""
    count = len(proxy.records)
    reader, writer = await asyncio.open_unix_connection(str(proxy.socket_path))
    writer.write(raw)
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    for _ in range(100):
        if len(proxy.records) > count:
            break
        await asyncio.sleep(0.02)
    return reply


@pytest.fixture
async def upstream():
    up = await Upstream().start()
    yield up
    up.close()


@pytest.fixture
async def proxy(upstream):
    config = policy_for(
        upstream,
        rate_per_minute={"api.allowed.test": 2},
        inject_headers={"api.allowed.test": {"Authorization": "Bearer host-secret"}},
    )
    with tempfile.TemporaryDirectory(prefix="skeg-", dir="/tmp") as tmp:
        p = EgressProxy(EgressPolicy.from_config(config), "test-session", Path(tmp) / "egress")
        await p.start()
        yield p
        await p.close()


def test_policies_never_grant_unrestricted_network():
    for bad in (["*"], ["*.com"], ["exa mple.com"], [], [7]):
        with pytest.raises(ConfigError):
            EgressPolicy.from_config({"allow": bad})
    with pytest.raises(ConfigError, match=r"0\.0\.0\.0/0"):
        EgressPolicy.from_config({"allow": ["a.example"], "allow_addresses": ["0.0.0.0/0"]})
    assert EgressPolicy.from_config("none") is None
    operator = EgressPolicy.from_config({"allow": ["*.example.com"], "ports": [443], "allow_addresses": ["10.0.0.0/8"]})
    narrowed = operator.narrowed({"allow": ["api.example.com"]})
    assert narrowed["allow"] == ["api.example.com"] and narrowed["allow_addresses"] == ["10.0.0.0/8"]
    for beyond in (
        {"allow": ["evil.org"]},
        {"allow": ["api.example.com"], "ports": [22]},
        {"allow": ["api.example.com"], "resolve": {"api.example.com": "10.0.0.1"}},
    ):
        with pytest.raises(EgressNotPermitted):
            operator.narrowed(beyond)


async def test_allowed_http_passes_with_injected_credentials(proxy, upstream):
    reply = await ask(
        proxy,
        f"GET http://api.allowed.test:{upstream.http_port}/v1?q=1 HTTP/1.1\r\nHost: x\r\n"
        "Proxy-Authorization: leak\r\n\r\n".encode(),
    )
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"hello from upstream")
    sent = upstream.requests[-1].decode()
    assert sent.startswith("GET /v1?q=1 HTTP/1.1") and "Authorization: Bearer host-secret" in sent
    assert "Proxy-Authorization" not in sent
    record = proxy.records[-1]
    assert (record.verdict, record.host, record.method) == ("allowed", "api.allowed.test", "GET")
    assert record.bytes_down == len(reply) and record.bytes_up == 0


async def test_connect_tunnel_to_an_allowed_host(proxy, upstream):
    reader, writer = await asyncio.open_unix_connection(str(proxy.socket_path))
    writer.write(f"CONNECT allowed.test:{upstream.echo_port} HTTP/1.1\r\n\r\n".encode())
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    writer.write(b"ping")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 10) == b"echo:ping"
    writer.close()
    await asyncio.sleep(0.1)
    assert proxy.records[-1].bytes_up == 4 and proxy.records[-1].method == "CONNECT"


async def test_refusals_make_no_connection(proxy, upstream):
    cases = {
        f"GET http://evil.test:{upstream.http_port}/ HTTP/1.1\r\n\r\n": (b"403", b"evil.test is not in the allowlist"),
        f"CONNECT evil.test:{upstream.echo_port} HTTP/1.1\r\n\r\n": (b"403", b"evil.test is not in the allowlist"),
        "CONNECT allowed.test:22 HTTP/1.1\r\n\r\n": (b"403", b"port 22 is not allowed"),
        f"CONNECT private.test:{upstream.echo_port} HTTP/1.1\r\n\r\n": (b"403", b"not a public address"),
        f"GET https://allowed.test:{upstream.http_port}/ HTTP/1.1\r\n\r\n": (b"400", b"only http:// URLs and CONNECT"),
        "CONNECT 10.0.0.1:443 HTTP/1.1\r\n\r\n": (b"403", b"not in the allowlist"),
        "BREW /pot HTCPCP/1.0\r\n\r\n": (b"400", b"not an HTTP/1.x proxy request"),
        f"GET http://allowed.test:{upstream.http_port}/ HTTP/1.1\r\nX: {'a' * 70000}\r\n\r\n": (
            b"431",
            b"too large",
        ),
    }
    for request, (status, reason) in cases.items():
        reply = await ask(proxy, request.encode())
        assert reply.split(b" ")[1] == status and reason in reply, (request[:60], reply[:200])
    assert upstream.connections == 0, "a refused request reached an upstream"
    assert [r.verdict for r in proxy.records] == ["denied"] * len(cases)


async def test_rate_limit_is_enforced(proxy, upstream):
    request = f"GET http://api.allowed.test:{upstream.http_port}/ HTTP/1.1\r\n\r\n".encode()
    statuses = [(await ask(proxy, request)).split(b" ")[1] for _ in range(3)]
    assert statuses == [b"200", b"200", b"429"]
    assert "rate limit of 2 requests per minute" in proxy.records[-1].reason


@pytest.fixture(scope="module")
async def egress_gateway(tmp_path_factory):
    up = await Upstream().start()
    policy = EgressPolicy.from_config(policy_for(up))
    async with running_gateway(tmp_path_factory.mktemp("egress"), egress_policy=policy) as gw:
        yield gw, up
    up.close()


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_sandbox_reaches_allowed_hosts_only_and_everything_is_audited(egress_gateway, runtime):
    require_runtime(runtime)
    gateway, up = egress_gateway
    code, session = await gateway.request(
        "POST", "/api/sessions", {"limits": {"runtime": runtime, "network": {"allow": ["allowed.test"]}}}
    )
    assert code == 201, session
    sid = session["id"]
    try:

        async def run(source: str) -> dict:
            return (await gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": source, "timeout": 60}))[1]

        ok = await run(
            f"import urllib.request\nprint(urllib.request.urlopen('http://allowed.test:{up.http_port}/hi').read().decode())"
        )
        assert ok["status"] == "ok" and ok["text"] == "hello from upstream\n", ok
        denied = await run(f"urllib.request.urlopen('http://api.allowed.test:{up.http_port}/')")
        assert denied["status"] == "error" and "sandkernel egress policy" in "".join(
            denied["error"]["traceback"] + [denied["error"]["value"]]
        )
        before = up.connections
        offline = await run(
            f"import socket\ntry:\n    socket.getaddrinfo('allowed.test', 80); print('resolved')\nexcept socket.gaierror:\n    print('no dns')\n"
            f"s = socket.socket()\ntry:\n    s.connect(('127.0.0.1', {up.http_port})); print('direct')\nexcept OSError as e:\n    print('no route', e.errno)"
        )
        assert offline["text"].splitlines()[0] == "no dns" and offline["text"].splitlines()[1].startswith("no route")
        assert up.connections == before, "the sandbox reached the upstream without the proxy"
        code, audit = await gateway.request("GET", f"/api/sessions/{sid}/egress")
        assert code == 200 and audit["policy"]["allow"] == ["allowed.test"]
        verdicts = [(r["host"], r["verdict"]) for r in audit["records"]]
        assert verdicts == [("allowed.test", "allowed"), ("api.allowed.test", "denied")]
        assert all(r["at"] and r["port"] == up.http_port for r in audit["records"])
        _, notebook = await gateway.request("GET", f"/api/sessions/{sid}/notebook")
        nb = nbformat.from_dict(notebook)
        assert nb.metadata["sandkernel"]["egress"]["denied"] == 1
        assert "sandkernel egress policy" in json.dumps(nb.cells[1].outputs)
    finally:
        await gateway.request("DELETE", f"/api/sessions/{sid}")


@pytest.mark.docker
async def test_sessions_cannot_widen_the_operator_policy(egress_gateway):
    gateway, _ = egress_gateway
    for network, status in [
        ({"allow": ["evil.test"]}, 403),
        ({"allow": ["allowed.test"], "allow_addresses": ["10.0.0.0/8"]}, 403),
        ({"allow": ["allowed.test"], "ports": [22]}, 403),
        ({"allow": ["*"]}, 400),
        ("everything", 400),
    ]:
        code, body = await gateway.request("POST", "/api/sessions", {"limits": {"network": network}})
        assert code == status and body["error"] in ("egress_not_permitted", "bad_network"), (network, body)


@pytest.mark.docker
async def test_a_gateway_without_an_egress_policy_grants_no_network(tmp_path):
    plain = await start_gateway(tmp_path)  # no --egress-policy: no network for anyone
    try:
        # An answer is due at once (nothing is started): a short timeout, so a hang fails here, in
        # this test's time, not after the suite's per-test timeout has moved on to the next test.
        code, body = await plain.request(
            "POST", "/api/sessions", {"limits": {"network": "operator"}}, request_timeout=60
        )
        assert code == 403 and "--egress-policy" in body["message"]
    finally:
        await stop_gateway(plain)


def index_addresses() -> list[str]:
    found = set()
    for host in ("pypi.org", "files.pythonhosted.org"):
        found |= {info[4][0] for info in socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)}
    return sorted(a for a in found if not ipaddress.ip_address(a).is_global)


@pytest.mark.index
@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_pip_install_through_the_proxy_persists_across_restart(tmp_path, runtime):
    """The one test that leaves the machine: to the package index this machine's pip uses."""
    require_runtime(runtime)
    try:
        private = index_addresses()
    except OSError:
        pytest.skip("this machine cannot resolve pypi.org")
    policy = {
        "allow": ["pypi.org", "files.pythonhosted.org"],
        "ports": [443],
        "allow_addresses": [f"{a}/32" for a in private],
        "ca_bundle": "/etc/ssl/certs/ca-certificates.crt",
    }
    gateway = await start_gateway(tmp_path, egress_policy=EgressPolicy.from_config(policy))
    try:
        code, session = await gateway.request(
            "POST", "/api/sessions", {"limits": {"runtime": runtime, "network": "operator"}}
        )
        assert code == 201, session
        sid = session["id"]

        async def run(source: str, timeout: float = 240) -> dict:
            return (
                await gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": source, "timeout": timeout})
            )[1]

        installed = await run("%pip install --no-cache-dir --disable-pip-version-check iniconfig==2.0.0")
        assert installed["status"] == "ok" and "Successfully installed iniconfig-2.0.0" in installed["text"], installed[
            "text"
        ][-2000:]
        assert (await run("import iniconfig; print(iniconfig.__name__)"))["text"] == "iniconfig\n"
        await gateway.request("POST", f"/api/sessions/{sid}/restart")
        assert (await run("import iniconfig; print('still importable')"))["text"] == "still importable\n"
        _, audit = await gateway.request("GET", f"/api/sessions/{sid}/egress")
        hosts = {r["host"] for r in audit["records"] if r["verdict"] == "allowed"}
        assert hosts <= {"pypi.org", "files.pythonhosted.org"} and "pypi.org" in hosts
    finally:
        await stop_gateway(gateway)
