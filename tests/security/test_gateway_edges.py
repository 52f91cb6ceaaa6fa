"""The gateway's own edges (issue 11, item 8): what an anonymous client learns, what the access
log keeps, token guessing, slow-header clients and a shared tokens file; /metrics served to the
operator alone (issue 30, item 7)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest

from sandkernel.errors import ConfigError
from sandkernel.gateway.auth import MAX_AUTH_FAILURES, TokenAuth
from sandkernel.gateway.metrics import GatewayMetrics, ThrottledReading

from ..gateway_fixtures import ALICE, BOB, OPERATOR, start_gateway, stop_gateway

pytestmark = pytest.mark.security


@pytest.fixture
async def gateway(tmp_path):
    gw = await start_gateway(tmp_path, header_timeout=1.0)
    yield gw
    await stop_gateway(gw)


@pytest.mark.docker
async def test_health_without_a_token_reveals_no_counts(gateway):
    status, anonymous = await gateway.request("GET", "/api/health", token=None)
    assert status == 200 and anonymous == {"status": "ok", "version": anonymous["version"]}
    status, wrong = await gateway.request("GET", "/api/health", token="not-a-token-0123456789")
    assert status == 200 and "sessions" not in wrong
    status, known = await gateway.request("GET", "/api/health", token=ALICE)
    assert status == 200 and known["sessions"] == 0 and "warm_pool" in known


@pytest.mark.docker
async def test_metrics_are_served_to_the_operators_token_alone(gateway):
    """The metrics count every tenant's sessions, snapshots and executions: neither an anonymous
    caller nor a tenant reads them (each got a 200 before), only the operator's scraper."""
    status, body = await gateway.request("GET", "/metrics", token=None)
    assert status == 401 and "metrics token" in body["message"], body
    status, body = await gateway.request("GET", "/metrics", token=ALICE)
    assert status == 401 and "not a tenant's" in body["message"], body
    status, metrics = await gateway.request("GET", "/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}, token=None)
    assert status == 200 and "sandkernel_sessions " in metrics, metrics
    status, metrics = await gateway.request("GET", "/metrics", token=OPERATOR)
    assert status == 200 and "sandkernel_sessions " in metrics
    # The operator's token opens nothing else: it is not a tenant's.
    status, _ = await gateway.request("GET", "/api/sessions", token=OPERATOR)
    assert status == 401


@pytest.mark.docker
async def test_metrics_are_closed_when_the_operator_set_no_token(tmp_path):
    gw = await start_gateway(tmp_path, metrics_token=None)
    try:
        status, body = await gw.request("GET", "/metrics", token=ALICE)
        assert status == 403 and "--metrics-token" in body["message"], body
        status, _ = await gw.request("GET", "/api/health", token=None)
        assert status == 200
    finally:
        await stop_gateway(gw)


def test_a_metrics_token_must_be_long_and_no_tenants():
    auth = TokenAuth({ALICE: "alice"})
    with pytest.raises(ConfigError, match="differ from every tenant's token"):
        auth.set_metrics_token(ALICE)
    with pytest.raises(ConfigError, match="16"):
        auth.set_metrics_token("short")
    auth.set_metrics_token(OPERATOR)
    assert auth.is_metrics_token(f"Bearer {OPERATOR}") and not auth.is_metrics_token(f"token {ALICE}")
    assert auth.tenant_for(f"token {OPERATOR}") is None


async def test_scrapes_share_one_walk_of_the_snapshot_store():
    """Each scrape used to walk every tenant's snapshots in the shared worker threads: now one
    walk per interval serves every scrape in it, however many arrive at once."""
    walks = []

    def walk() -> int:
        walks.append(1)
        return 4096 * len(walks)

    reading = ThrottledReading(GatewayMetrics().snapshot_bytes, interval=3600)
    await asyncio.gather(*(reading.refresh(walk) for _ in range(50)))
    await reading.refresh(walk)
    assert len(walks) == 1 and reading.gauge._value.get() == 4096
    reading.interval = 0
    await reading.refresh(walk)
    assert len(walks) == 2 and reading.gauge._value.get() == 8192


@pytest.mark.docker
async def test_a_refused_url_token_stays_out_of_the_access_log(gateway, caplog):
    secret = "url-secret-" + ALICE
    with caplog.at_level(logging.INFO, logger="tornado.access"):
        status, body = await gateway.request("GET", f"/api/sessions?token={secret}", token=None)
        assert status == 401 and "tokens in the URL are refused" in body["message"]
        status, _ = await gateway.request("GET", f"/api/sessions?x={secret}", token=ALICE)
        assert status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "tornado.access"]
    assert len(lines) == 2 and all("/api/sessions" in line for line in lines), lines
    assert not any(secret in line or "token=" in line for line in lines), lines


@pytest.mark.docker
async def test_token_guessing_is_cut_off_but_valid_tokens_still_pass(gateway):
    for _ in range(MAX_AUTH_FAILURES):
        status, body = await gateway.request("GET", "/api/sessions", token="guess-" + "0" * 20)
        assert status == 401, body
    status, body = await gateway.request("GET", "/api/sessions", token=ALICE[:-1] + "Z")
    assert status == 429 and "too many failed authentications" in body["message"], body
    # Even the right token for another tenant is not checked for a held-back guesser... but a
    # request with a valid token is never held back (a tenant behind the same address).
    status, sessions = await gateway.request("GET", "/api/sessions", token=BOB)
    assert status == 200 and sessions == []


@pytest.mark.docker
async def test_slow_header_clients_are_disconnected(gateway):
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(b"GET /api/health HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), timeout=30)  # EOF once the gateway gives up
    assert data == b""
    writer.close()
    status, _ = await gateway.request("GET", "/api/health", token=None)
    assert status == 200


def test_a_tokens_file_others_can_read_is_refused(tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"alice": ALICE}))
    tokens.chmod(0o644)
    with pytest.raises(ConfigError, match=r"readable or writable by group or others \(mode 0644\); run: chmod 600"):
        TokenAuth.from_sources(tokens_file=str(tokens))
    tokens.chmod(0o600)
    auth, shown = TokenAuth.from_sources(tokens_file=str(tokens))
    assert shown is None and auth.tenant_for(f"token {ALICE}") == "alice"


def test_the_gateway_port_is_closed_after_a_refused_tokens_file(tmp_path):
    """A refused tokens file stops `sandkernel serve` before it listens (no half-started gateway)."""
    import subprocess
    import sys

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"alice": ALICE}))
    tokens.chmod(0o640)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "sandkernel.cli", "serve", "--port", str(port), "--tokens-file", str(tokens)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "chmod 600" in done.stderr and "Traceback" not in done.stderr, done.stderr
