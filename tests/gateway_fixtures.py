"""A real gateway on a loopback port, in the test's event loop, with two tenants."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.httputil import HTTPHeaders

from sandkernel.gateway.budget import OutputBudget
from sandkernel.gateway.server import Gateway as RunningGateway
from sandkernel.gateway.settings import GatewaySettings

from .conftest import RUNTIME_PARAMS, require_runtime

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef00"
OPERATOR = "operator-metrics-token-0123456789"  # the operator's /metrics token (--metrics-token)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port held bound but never listening: every connect to it is refused. For a
    test of "nothing listens there": a port only found free (free_port) was once taken meanwhile
    by another worker's server, which accepted and did not answer (a timeout, not a refusal)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


async def call_api(
    url: str,
    method: str,
    body: Any = None,
    token: str | None = ALICE,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    request_timeout: float = 300,
    **kw: Any,
) -> tuple[int, Any, HTTPHeaders]:
    """One request to a gateway's API as the tenant of ``token`` (None: no Authorization):
    ``body`` sent as JSON (or ``raw`` bytes; a POST or PUT without either sends an empty body).
    Returns (status, the JSON answer, or its text when it is not JSON, or None when empty, the
    response headers); an error status is returned, not raised. What every test's gateway
    client (Gateway.request, Serve.call) sends through."""
    sent = {"Authorization": f"token {token}"} if token else {}
    sent.update(headers or {})
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    if method in ("POST", "PUT") and data is None:
        data = b""
    request = HTTPRequest(url, method=method, body=data, headers=sent, request_timeout=request_timeout, **kw)
    try:
        response = await AsyncHTTPClient().fetch(request)
    except HTTPClientError as err:
        assert err.response is not None, err  # no answer at all (refused, timed out): a failure
        response = err.response
    text = response.body.decode(errors="replace") if response.body else ""
    try:
        return response.code, json.loads(text) if text else None, response.headers
    except ValueError:
        return response.code, text, response.headers


@dataclass
class Gateway:
    url: str
    port: int
    server: RunningGateway  # its registry is there for tests that must reach behind the API
    runtime: str | None = None  # the runtime a fixture parametrised over the runtimes started it for

    @property
    def settings(self) -> GatewaySettings:
        return self.server.settings

    async def request(
        self, method: str, path: str, body: Any = None, token: str | None = ALICE, raw: bytes | None = None, **kw: Any
    ) -> tuple[int, Any]:
        status, data, _ = await call_api(self.url + path, method, body, token, raw=raw, **kw)
        return status, data


# What test gateways use unless a test says otherwise: few sessions, runc (fast, and the
# runtime every machine has), no warm pool (each test that wants one says so), and every
# container removed when the gateway stops (the default keeps them for the next gateway).
TEST_DEFAULTS: dict[str, Any] = {
    "max_sessions": 4,
    "default_runtime": "runc",
    "pool_size": 0,
    "on_exit": "delete",
    "metrics_token": OPERATOR,
}
# For a test of what a replay resume, fork or rewind does (its verdicts, its labels), under gVisor
# too (the default, --memory-snapshots auto, keeps gVisor kernels' memory where the host can):
# memory checkpoints: tests/test_memory_snapshots.py.
REPLAY: dict[str, Any] = {"memory_snapshots": "off"}


async def start_gateway(
    tmp_path, budget: OutputBudget | None = None, egress_policy: Any = None, **options: Any
) -> Gateway:
    """A gateway on a free loopback port with tenants alice and bob. ``options`` are
    :class:`GatewaySettings` fields; ``budget`` (an OutputBudget) and ``egress_policy`` (an
    EgressPolicy, written to a file as an operator would) are accepted as the tests always passed them."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"alice": ALICE, "bob": BOB}))
    tokens.chmod(0o600)  # the gateway refuses a tokens file others can read
    if budget is not None:
        options.update(
            output_budget=budget.max_text_bytes, max_images=budget.max_images, max_image_bytes=budget.max_image_bytes
        )
    if egress_policy is not None:
        policy_file = tmp_path / "egress-policy.json"
        policy_file.write_text(json.dumps(egress_policy.to_config()))
        options["egress_policy_file"] = policy_file
    options.setdefault("state_dir", tmp_path / "state")  # its own catalog: it adopts nobody else's sandboxes
    settings = GatewaySettings(ip="127.0.0.1", port=free_port(), tokens_file=tokens, **{**TEST_DEFAULTS, **options})
    server = await asyncio.wait_for(RunningGateway.start(settings), 60)
    return Gateway(server.url, settings.port, server)


async def stop_gateway(gateway: Gateway) -> None:
    await asyncio.wait_for(gateway.server.stop(), 120)


@contextlib.asynccontextmanager
async def running_gateway(tmp_path, **options: Any) -> AsyncIterator[Gateway]:
    """``async with running_gateway(tmp_path, **options) as gw:`` a gateway of :func:`start_gateway`,
    stopped on the way out even when the block fails: for fixtures that do more than start one."""
    gateway = await start_gateway(tmp_path, **options)
    try:
        yield gateway
    finally:
        await stop_gateway(gateway)


def gateway_fixture(scope: str = "module", runtimes: bool | list[Any] = False, **options: Any):
    """A fixture yielding a gateway of :func:`start_gateway` with ``options``, so a module's gateway
    is one line: ``gateway = gateway_fixture(max_sessions=3)`` (pytest names the fixture after the
    module-level name it is bound to). With ``runtimes``, one gateway per runtime of
    RUNTIME_PARAMS (or of the list given, such as DOOR_RUNTIME_PARAMS; their marks reach the
    tests), each defaulting to its runtime (``gw.runtime``). A test takes other runtimes than its
    module's with ``@pytest.mark.parametrize("gateway", RUNTIME_PARAMS, indirect=True)``."""
    params = RUNTIME_PARAMS if runtimes is True else (runtimes or None)

    @pytest.fixture(scope=scope, params=params)
    async def gateway(
        request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
    ) -> AsyncIterator[Gateway]:
        runtime = request.param if params else None
        chosen = dict(options)
        if runtime is not None:
            require_runtime(runtime)
            chosen["default_runtime"] = runtime
        async with running_gateway(tmp_path_factory.mktemp(f"gateway-{runtime or 'default'}"), **chosen) as gw:
            gw.runtime = runtime
            yield gw

    return gateway


def rss_mib() -> float:
    """This process's resident memory (the in-process gateway's)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class PeakRss:
    """``async with PeakRss() as rss:`` samples this process's RSS every 50 ms; ``rss.growth`` is
    the peak minus the RSS at entry, in MiB."""

    async def __aenter__(self) -> PeakRss:
        self.baseline = self.peak = rss_mib()
        self._task = asyncio.create_task(self._watch())
        return self

    async def _watch(self) -> None:
        while True:
            self.peak = max(self.peak, rss_mib())
            await asyncio.sleep(0.05)

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        self.peak = max(self.peak, rss_mib())

    @property
    def growth(self) -> float:
        return self.peak - self.baseline
