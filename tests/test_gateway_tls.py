"""HTTPS and WSS on the gateway (``--certfile``/``--keyfile``), and a cluster whose gateways
forward tenants' requests to each other over TLS, checking each other's certificate.

Real parts: certificates made by the ``openssl`` command (a throwaway CA, a certificate for
127.0.0.1), ``sandkernel serve`` processes, PostgreSQL, real HTTPS and WSS clients.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tornado import websocket
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from sandkernel.errors import ConfigError
from sandkernel.gateway.settings import GatewaySettings

from .certificates import Certificates, make_certificates
from .gateway_fixtures import ALICE, call_api
from .kernel_websocket import run_cell
from .test_cluster_membership import clean_up_hosts, cluster_flags, rows
from .test_durable_sessions import Serve


class TlsServe(Serve):
    """``sandkernel serve`` on HTTPS, called by a client that trusts the test's CA."""

    def __init__(self, tmp_path: Path, runtime: str, certificates: Certificates) -> None:
        super().__init__(tmp_path, runtime)
        self.certificates = certificates

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def tls_flags(self) -> tuple[str, ...]:
        return ("--certfile", str(self.certificates.cert), "--keyfile", str(self.certificates.key))

    async def call(self, method: str, path: str, body: Any = None, token: str = ALICE) -> tuple[int, Any]:
        status, data, _ = await call_api(self.url + path, method, body, token, ca_certs=str(self.certificates.ca))
        return status, data


def test_a_certificate_without_its_key_is_refused_with_what_to_do():
    with pytest.raises(ConfigError, match="both --certfile and --keyfile"):
        GatewaySettings(certfile=Path("/etc/ssl/gateway.pem"))
    with pytest.raises(ConfigError, match="both --certfile and --keyfile"):
        GatewaySettings(keyfile=Path("/etc/ssl/gateway.key"))
    assert GatewaySettings().scheme == "http"
    assert GatewaySettings(certfile=Path("c"), keyfile=Path("k")).scheme == "https"


def test_a_certificate_that_cannot_be_used_stops_the_start_with_what_to_fix(tmp_path):
    certificates = make_certificates(tmp_path / "tls")
    other = make_certificates(tmp_path / "other")
    for cert, key, said in (
        (tmp_path / "missing.pem", certificates.key, "does not exist"),
        (certificates.key, certificates.key, "cannot be used"),  # a key where the certificate goes
        (certificates.cert, other.key, "cannot be used"),  # another certificate's key
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "sandkernel.cli", "serve", "--token", "t" * 32, "--port", "0",
             "--state-dir", str(tmp_path / "state"), "--certfile", str(cert), "--keyfile", str(key)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode != 0 and said in proc.stderr + proc.stdout, (proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "state" / "catalog.sqlite3").exists()  # stopped before the catalog was opened


@pytest.mark.docker
async def test_gateways_serve_https_and_wss_and_forward_to_each_other_over_tls(
    tmp_path, fresh_postgres_url, monkeypatch
):
    url = fresh_postgres_url
    certificates = make_certificates(tmp_path / "tls")
    a, b, c = (TlsServe(tmp_path / name, "runc", certificates) for name in ("a", "b", "c"))
    ids: list[str] = []
    try:
        # The gateways' trust store for the hop: the cluster's CA (inherited by a and b).
        monkeypatch.setenv("SSL_CERT_FILE", str(certificates.ca))
        await b.start(*cluster_flags(tmp_path, url, "host-b", b), *b.tls_flags())
        held = await b.create()  # b is the only host: the session is b's
        ids.append(held["id"])
        await a.start(*cluster_flags(tmp_path, url, "host-a", a), *a.tls_flags())
        # c does not trust the cluster's CA (the system's store only): it must not forward in clear.
        monkeypatch.delenv("SSL_CERT_FILE")
        await c.start(*cluster_flags(tmp_path, url, "host-c", c), *c.tls_flags())
        urls = dict(rows(url, "SELECT host_id, url FROM hosts"))
        assert urls == {"host-a": a.url, "host-b": b.url, "host-c": c.url}, urls
        assert all(u.startswith("https://") for u in urls.values())

        # Through a: HTTPS to a, then a's hop to b over TLS (b listens on TLS only).
        assert (await a.execute(held["id"], "x = 6 * 7; print(x)"))["text"] == "42\n"
        status, listed = await a.call("GET", "/api/sessions")
        assert status == 200 and held["id"] in {s["id"] for s in listed}
        # The kernel websocket through a: WSS to a, relayed over WSS to b.
        kernel_id = held["kernel"]["id"]
        ws = await websocket.websocket_connect(
            HTTPRequest(
                f"wss://127.0.0.1:{a.port}/api/kernels/{kernel_id}/channels",
                headers={"Authorization": f"token {ALICE}"},
                ca_certs=str(certificates.ca),
            )
        )
        try:
            reply, text = await run_cell(ws, "print(x + 1)")
            assert reply["status"] == "ok" and text == "43\n", (reply, text)
        finally:
            ws.close()

        # Plain HTTP on the TLS port is not served.
        with pytest.raises((HTTPClientError, OSError)):
            await AsyncHTTPClient().fetch(f"http://127.0.0.1:{a.port}/api", request_timeout=10)
        # c cannot check b's certificate: a 503 naming b, and nothing sent in clear.
        status, body = await c.call("POST", f"/api/sessions/{held['id']}/execute", {"code": "print(x)"})
        assert status == 503 and "host-b" in body["message"], (status, body)
        assert (await b.execute(held["id"], "print(x)"))["text"] == "42\n"  # b's state is untouched
    finally:
        await clean_up_hosts((b, ids), (a, []), (c, []))
