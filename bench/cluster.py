"""What a cluster of gateways costs and spreads (issue 18), each beside its baseline, in one run:

1. Forwarding overhead: a trivial execute (``1+1``, session API, one keep-alive connection per
   contender) on a session host A holds, sent straight to A vs sent to host F, which forwards it
   to A (a catalog look-up, cached briefly, and a signed hop on a kept-alive connection); the
   NDJSON streaming execute and a GET of the session's model (the hop's cost without the
   kernel's) the same two ways. The contenders take turns call by call, in a new (seeded) order
   each round, so load and drift on this shared machine hit them alike; besides each p50, the median of the
   paired differences (forwarded minus direct, same round) is printed, the figure least moved by
   other work on the machine. Target printed: forwarding adds <= 1 ms p50. The CPU each gateway
   spends per call (schedstat, every thread) is counted after the timed calls, each call alone
   with 30 ms of quiet around it, so the owner's after-answer work is counted with its own call.
   A third execute contender is what a ``direct_to_owner`` client does with F as its endpoint:
   F's answer names the session's host (``X-Sandkernel-Host``), and the calls go there; its own
   target line says what such a client adds.
2. Session create round trip (POST /api/sessions → 201) straight on A, which places it on itself,
   vs through F, which places it on A and forwards the create there, alternated one by one.
   Placement is made deterministic: F runs with --max-sessions-total 1, so its free room (at
   most 1) never beats A's; the catalog is asked where each session went, and every one must be
   on A. Each session is deleted (not timed) before the next create.
3. Create throughput: a burst of ``--burst`` creates at once through one endpoint, with the
   session landing on 1 host (A, the pair's placement puts them all there) vs spread over a
   cluster of 3 hosts with equal room (the burst sent to one of them, which places a share on
   each and forwards the others' creates). Bursts alternate 1 / 3 hosts (``--bursts`` each);
   sessions/s = successful creates / the burst's wall time; where they landed is counted from
   the catalog.
4. The hop's client alone, before vs after: POSTs one after another to one tornado server (in a
   process of its own) through tornado's SimpleAsyncHTTPClient, which forwarding used (a new TCP
   connection and a resolver thread per request), vs through the peer pool; CPU and wall per call.

Every host here is a ``sandkernel serve`` in cluster mode (--catalog-url, --cluster-secret-file,
--host-id, --advertise-url; pool size 0, runc, --on-exit delete) on THIS machine: all of them
share its cores and its one Docker engine, so the 3-host figure measures the cluster's overhead
and how it spreads a burst, not more capacity (a real cluster adds the other machines' cores and
engines). The catalog is a throwaway PostgreSQL 15 (tests/postgres_fixtures.py's
``running_postgres``: Debian's binaries, loopback only), one database per cluster: the pair
(A, F) and the trio. Five gateways in all; everything is deleted and stopped at the end, and the
run fails if any container of its gateways is left.

Prints p50/p95, the added milliseconds and the ratios; writes bench/results/cluster.json.
Usage: python bench/cluster.py [--n 300] [--creates 20] [--burst 30] [--bursts 2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
from execute_roundtrip import TOKEN, free_port, stats, wait_http
from results_dir import results_path
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from sandkernel.owner_hint import HOST_HEADER

REPO = Path(__file__).resolve().parents[1]
TENANT = "bench"
RUNTIME = "runc"  # forwarding and placement do not touch the sandbox: one runtime is enough
HEARTBEAT_SECONDS = 1.0  # free room is recounted at each beat; the bursts wait for it between them
SHARED_MACHINE = (
    "all hosts share this machine's {cpus} cores and one Docker engine: the 3-host figure measures the "
    "cluster's overhead and spread, not more capacity (a real cluster adds the other machines' cores)"
)
EXECUTE, STREAM, SESSION_GET = "execute 1+1", "NDJSON stream execute 1+1", "GET the session (the hop alone)"
DIRECT, FORWARDED = "straight to the owner", "through another host (forwarded)"
# A client with direct_to_owner (sandkernel/owner_hint.py): its endpoint is F, but after F's first
# answer named the owner it sends the session's calls there.
NAMED = "to the host F's answer named (direct_to_owner)"
# CPU per call is counted apart from the timed calls, each call alone with this much quiet
# before and after (cpu_per_call), on at most CPU_CALLS calls per contender.
QUIET_SECONDS = 0.03
CPU_CALLS = 100


class Host:
    """One cluster gateway: ``sandkernel serve`` with the cluster flags, its own state and notebook
    dirs and port, output kept in a log file (shown if it fails to start)."""

    def __init__(self, root: Path, host_id: str, catalog_url: str, secret: Path, tokens: Path, capacity: int) -> None:
        self.host_id = host_id
        self.dir = root / host_id
        self.dir.mkdir()
        self.state = (self.dir / "state").resolve()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.dir / "serve.log"
        # fmt: off
        self.command = [
            sys.executable, "-m", "sandkernel.cli", "--log-level", "INFO", "serve", "--port", str(self.port),
            "--tokens-file", str(tokens), "--state-dir", str(self.state), "--notebook-dir", str(self.dir / "notebooks"),
            "--pool-size", "0", "--default-runtime", RUNTIME, "--on-exit", "delete",
            "--max-sessions-total", str(capacity), "--max-sessions", str(10 * capacity),
            "--catalog-url", catalog_url, "--cluster-secret-file", str(secret), "--host-id", host_id,
            "--advertise-url", self.url, "--heartbeat-seconds", str(HEARTBEAT_SECONDS),
        ]
        # fmt: on
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> Host:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        try:
            await wait_http(f"{self.url}/api/health", self.proc)
        except RuntimeError as err:
            raise RuntimeError(f"{self.host_id} did not start: {err}\n{self.log.read_text()[-3000:]}") from None
        return self

    def cpu_seconds(self) -> float:
        """CPU time this gateway process (all its threads) has used so far, in nanoseconds from
        each thread's /proc schedstat: /proc/PID/stat counts whole clock ticks (10 ms), coarser
        than the 1-5 ms a call costs, so a per-call figure from it is mostly sampling noise."""
        assert self.proc is not None
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that just ended
                total += int((task / "schedstat").read_text().split()[0])
        return total / 1e9

    async def stop(self) -> None:
        """SIGTERM (its sandboxes deleted: --on-exit delete); SIGKILL after 120 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.proc.wait, 120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait, 30)
            raise RuntimeError(f"{self.host_id} did not stop on SIGTERM within 120 s; killed") from None

    def leftovers(self) -> list[str]:
        """Containers of this gateway still on the engine (they carry its state dir's label)."""
        out = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=sandkernel.state_dir={self.state}"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.split()


class Catalog:
    """Read-only questions to one cluster's PostgreSQL catalog (where sessions went, hosts' room)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _rows(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
            return conn.execute(sql, params).fetchall()

    async def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return await asyncio.to_thread(self._rows, sql, params)

    async def holders(self, session_ids: list[str]) -> dict[str, str]:
        """session id → the host id that holds it."""
        rows = await self.rows("SELECT session_id, host_id FROM sandboxes WHERE session_id = ANY(%s)", (session_ids,))
        return dict(rows)

    async def settled(self, hosts: list[Host], timeout: float = 60) -> None:
        """Wait until every host is up and its free room is its whole capacity again (nothing
        held, the places taken by a burst recounted by a heartbeat), so placement starts even."""
        ids = [host.host_id for host in hosts]
        deadline = time.monotonic() + timeout
        while True:
            rows = await self.rows("SELECT host_id, status, free, capacity FROM hosts WHERE host_id = ANY(%s)", (ids,))
            if len(rows) == len(ids) and all(status == "up" and free == cap for _, status, free, cap in rows):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the hosts did not settle (up, all room free) within {timeout:.0f} s: {rows}")
            await asyncio.sleep(0.2)


# -- 1. forwarding overhead on a trivial execute -----------------------------------------------------


class Trips:
    """One contender of the forwarding comparison: one kept-alive connection to one gateway, the
    same request each time, checked (a wrong answer fails the run)."""

    def __init__(self, host: Host, kind: str, session_id: str, port: int | None = None) -> None:
        self.host = host
        self.kind = kind
        self.conn = http.client.HTTPConnection("127.0.0.1", port or host.port, timeout=120)
        self.headers = {"Authorization": f"token {TOKEN}", "Content-Type": "application/json"}
        if kind == SESSION_GET:
            self.method, self.path, self.body = "GET", f"/api/sessions/{session_id}", None
        else:
            self.method, self.body = "POST", json.dumps({"code": "1+1"})
            self.path = f"/api/sessions/{session_id}/execute" + ("?stream=1" if kind == STREAM else "")

    def once(self) -> float:
        """Seconds of one round trip, the answer read to its end and checked."""
        began = time.perf_counter()
        self.conn.request(self.method, self.path, self.body, self.headers)
        response = self.conn.getresponse()
        data = response.read()
        elapsed = time.perf_counter() - began
        assert response.status == 200, (response.status, data[:500])
        if self.kind == SESSION_GET:
            assert json.loads(data)["id"] in self.path, data[:500]
            return elapsed
        if self.kind == STREAM:
            *events, last = (json.loads(line) for line in data.splitlines() if line.strip())
            assert last["type"] == "result", data[:500]
            reply, outputs = last["result"], [event["output"] for event in events if event["type"] == "output"]
        else:
            reply = json.loads(data)
            outputs = reply["outputs"]
        results = [out["data"].get("text/plain") for out in outputs if out.get("output_type") == "execute_result"]
        assert reply["status"] == "ok" and results == ["2"], data[:1000]
        return elapsed


def interleaved_trips(contenders: dict[str, Trips], n: int, warmup: int) -> dict[str, list[float]]:
    """Round by round, one call of each contender in a shuffled order, so load and drift on this
    shared machine hit direct and forwarded calls alike, down to the call. Returns the kept
    seconds per contender."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    # A new order each round (seeded): a fixed cycle, even rotated, puts each contender after the
    # same one every time, and what an execute leaves the owner doing after its answer (the
    # transcript) would then always fall on the forwarded execute that follows the direct one.
    order = random.Random(18)
    for round_number in range(n + warmup):
        order.shuffle(names)
        for name in names:
            elapsed = contenders[name].once()
            if round_number >= warmup:
                samples[name].append(elapsed)
    return samples


def cpu_per_call(contenders: dict[str, Trips], hosts: tuple[Host, Host], n: int) -> dict[str, list[float]]:
    """CPU seconds (A, F) per call of each contender, each call alone: :data:`QUIET_SECONDS`
    before it (the previous call's work is over) and counted until :data:`QUIET_SECONDS` after
    its answer. An execute's owner goes on working for a few ms after answering (the
    transcript's write-behind, the catalog write): counted in back-to-back calls, that work
    lands in whichever call's window it falls, most in the longest windows, which made a
    forwarded call look about 2 ms dearer on the owner than a direct one when it is not."""
    cpu = {name: [0.0, 0.0] for name in contenders}
    names = list(contenders)
    order = random.Random(19)
    for _ in range(n):
        order.shuffle(names)
        for name in names:
            time.sleep(QUIET_SECONDS)
            used = [host.cpu_seconds() for host in hosts]
            contenders[name].once()
            time.sleep(QUIET_SECONDS)
            for i, host in enumerate(hosts):
                cpu[name][i] += (host.cpu_seconds() - used[i]) / n
    return cpu


def named_port(forwarder: Host, session_id: str) -> int:
    """The port of the host F's answer about the session names (X-Sandkernel-Host): where a
    direct_to_owner client sends the session's calls after its first one."""
    conn = http.client.HTTPConnection("127.0.0.1", forwarder.port, timeout=60)
    try:
        conn.request("GET", f"/api/sessions/{session_id}", headers={"Authorization": f"token {TOKEN}"})
        response = conn.getresponse()
        response.read()
    finally:
        conn.close()
    named = urlsplit(response.getheader(HOST_HEADER) or "")
    assert response.status == 200 and named.hostname == "127.0.0.1" and named.port, response.getheader(HOST_HEADER)
    return named.port


async def forwarding(owner: Host, forwarder: Host, n: int, stream: bool, warmup: int = 5) -> dict[str, Any]:
    """Per contender: p50/p95 and the CPU each gateway (the owner A, the forwarder F) spent per
    call (:func:`cpu_per_call`); per kind, the p50 forwarding adds and the median of the paired differences (the
    forwarded call minus the direct call of the same round)."""
    status, model = await call(owner.url, "POST", "/api/sessions", {})
    assert status == 201, (status, model)
    session_id = model["id"]
    kinds = [EXECUTE, *([STREAM] if stream else []), SESSION_GET]
    try:
        contenders = {
            f"{kind}, {way}": Trips(host, kind, session_id)
            for kind in kinds
            for way, host in ((DIRECT, owner), (FORWARDED, forwarder))
        }
        port = await asyncio.to_thread(named_port, forwarder, session_id)
        assert port == owner.port, (port, owner.port)  # F named A, the session's host
        contenders[f"{EXECUTE}, {NAMED}"] = Trips(owner, EXECUTE, session_id, port)
        try:
            samples = await asyncio.to_thread(interleaved_trips, contenders, n, warmup)
            cpu = await asyncio.to_thread(cpu_per_call, contenders, (owner, forwarder), min(n, CPU_CALLS))
        finally:
            for trips in contenders.values():
                trips.conn.close()
    finally:
        await call(owner.url, "DELETE", f"/api/sessions/{session_id}")
    results: dict[str, Any] = {}
    for name, values in samples.items():
        owner_ms, forwarder_ms = (1000 * seconds for seconds in cpu[name])
        results[name] = {**stats(values), "owner_cpu_ms": owner_ms, "forwarder_cpu_ms": forwarder_ms}
    for kind in kinds:
        direct_name, forwarded_name = f"{kind}, {DIRECT}", f"{kind}, {FORWARDED}"
        direct, forwarded = results[direct_name], results[forwarded_name]
        forwarded["added_p50_ms"] = forwarded["p50_ms"] - direct["p50_ms"]
        forwarded["ratio_p50"] = forwarded["p50_ms"] / direct["p50_ms"]
        pairs = [f - d for f, d in zip(samples[forwarded_name], samples[direct_name], strict=True)]
        forwarded["paired_added_p50_ms"] = 1000 * statistics.median(pairs)
    named, direct = results[f"{EXECUTE}, {NAMED}"], results[f"{EXECUTE}, {DIRECT}"]
    named["added_p50_ms"] = named["p50_ms"] - direct["p50_ms"]
    named["ratio_p50"] = named["p50_ms"] / direct["p50_ms"]
    pairs = [f - d for f, d in zip(samples[f"{EXECUTE}, {NAMED}"], samples[f"{EXECUTE}, {DIRECT}"], strict=True)]
    named["paired_added_p50_ms"] = 1000 * statistics.median(pairs)
    return results


def _answer_forever(port: int) -> None:
    """A tornado server answering a POST with a small JSON body, as an owner answers an execute
    (a process of its own, so its CPU is not counted with the client's)."""
    from tornado import web
    from tornado.httpserver import HTTPServer

    class Answer(web.RequestHandler):
        def post(self) -> None:
            self.write({"outputs": [{"output_type": "execute_result", "data": {"text/plain": "2"}}], "status": "ok"})

    async def serve() -> None:
        HTTPServer(web.Application([("/answer", Answer)])).listen(port, "127.0.0.1")
        await asyncio.Event().wait()

    asyncio.run(serve())


async def client_alone(n: int) -> dict[str, dict[str, float]]:
    """The hop's client by itself, before vs after, in one run: ``n`` POSTs one after another to
    one tornado server, through tornado's SimpleAsyncHTTPClient (a new connection and a resolver
    thread per request: what forwarding used) and through the peer pool (kept-alive); this
    process's CPU and the wall time per call, in rounds that alternate."""
    import multiprocessing

    from tornado import httputil
    from tornado.simple_httpclient import SimpleAsyncHTTPClient

    from sandkernel.gateway.cluster.forward import new_peer_pool
    from sandkernel.gateway.cluster.peer_pool import Hop

    class Drain(httputil.HTTPMessageDelegate):
        def data_received(self, chunk: bytes) -> None:
            pass

    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=_answer_forever, args=(port,), daemon=True)
    server.start()
    url, body = f"http://127.0.0.1:{port}", json.dumps({"code": "1+1"}).encode()
    pool = new_peer_pool()
    headers = {"Authorization": f"token {TOKEN}"}

    async def pooled() -> None:
        await pool.fetch(url, "POST", "/answer", httputil.HTTPHeaders(headers), body, Drain(), Hop())

    async def simple() -> None:
        client = SimpleAsyncHTTPClient(force_instance=True)
        try:
            await client.fetch(HTTPRequest(url + "/answer", method="POST", body=body, headers=headers))
        finally:
            client.close()

    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                await simple()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        totals = {name: [0.0, 0.0] for name in ("SimpleAsyncHTTPClient (before)", "peer pool (now)")}
        for round_number in range(4):
            for name, one in zip(totals, (simple, pooled), strict=True):
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(n // 4):
                    await one()
                if round_number:  # the first round warms up
                    totals[name][0] += time.process_time() - cpu
                    totals[name][1] += time.perf_counter() - wall
    finally:
        pool.close()
        server.kill()
    calls = 3 * (n // 4)
    return {name: {"cpu_ms": 1000 * c / calls, "wall_ms": 1000 * w / calls} for name, (c, w) in totals.items()}


# -- 2. session create round trip: on the host that holds it vs forwarded there ----------------------


async def call(base: str, method: str, path: str, body: Any = None, client: AsyncHTTPClient | None = None,
               ) -> tuple[int, Any]:  # fmt: skip
    """(status, JSON) of one request with the bench tenant's token."""
    data = json.dumps(body).encode() if body is not None else (b"" if method in ("POST", "PUT") else None)
    request = HTTPRequest(
        base + path, method=method, body=data, headers={"Authorization": f"token {TOKEN}"}, request_timeout=300
    )
    try:
        response = await (client or AsyncHTTPClient()).fetch(request)
    except HTTPClientError as err:
        if err.response is None:
            raise
        response = err.response
    text = response.body.decode(errors="replace") if response.body else ""
    try:
        return response.code, json.loads(text) if text else None
    except ValueError:
        return response.code, text


def create_round_trip(port: int) -> tuple[float, dict[str, Any]]:
    """Seconds of one POST /api/sessions (a fresh connection, as a client creating a session
    makes) and the session model."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        began = time.perf_counter()
        conn.request("POST", "/api/sessions", "{}", {"Authorization": f"token {TOKEN}"})
        response = conn.getresponse()
        data = response.read()
        elapsed = time.perf_counter() - began
    finally:
        conn.close()
    assert response.status == 201, (response.status, data[:500])
    return elapsed, json.loads(data)


async def creates(owner: Host, forwarder: Host, catalog: Catalog, n: int) -> dict[str, Any]:
    """Create round trips straight on the owner vs through the forwarder, alternated (who goes
    first rotates); each session deleted on its holder before the next create."""
    contenders = {f"create, {DIRECT}": owner, f"create, {FORWARDED}": forwarder}
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_number in range(n + 1):  # round 0 warms both paths up, not kept
        for name in names[round_number % 2 :] + names[: round_number % 2]:
            host = contenders[name]
            elapsed, model = await asyncio.to_thread(create_round_trip, host.port)
            try:
                holder = (await catalog.holders([model["id"]])).get(model["id"])
                if holder != owner.host_id:
                    raise RuntimeError(f"placement was to put every create on {owner.host_id}; {name}: {holder}")
            finally:
                status, body = await call(owner.url, "DELETE", f"/api/sessions/{model['id']}")
                assert status == 204, (status, body)
            if round_number:
                samples[name].append(elapsed)
    results: dict[str, Any] = {name: stats(values) for name, values in samples.items()}
    direct, forwarded = results[f"create, {DIRECT}"], results[f"create, {FORWARDED}"]
    forwarded["added_p50_ms"] = forwarded["p50_ms"] - direct["p50_ms"]
    forwarded["ratio_p50"] = forwarded["p50_ms"] / direct["p50_ms"]
    return results


# -- 3. create throughput: a burst through one endpoint, 1 host vs 3 --------------------------------


async def burst(endpoint: Host, hosts: list[Host], catalog: Catalog, n: int) -> dict[str, Any]:
    """``n`` creates at once through ``endpoint``; sessions/s, each create's time, where they
    landed (from the catalog), failures; then every session deleted and the hosts settled."""
    await catalog.settled(hosts)
    client = AsyncHTTPClient(force_instance=True, max_clients=n)
    times: list[float] = []
    failures: collections.Counter[str] = collections.Counter()
    made: list[str] = []

    async def one() -> None:
        began = time.perf_counter()
        status, model = await call(endpoint.url, "POST", "/api/sessions", {}, client)
        if status == 201:
            times.append(time.perf_counter() - began)
            made.append(model["id"])
        else:
            message = model.get("message", model) if isinstance(model, dict) else model
            failures[f"{status} {str(message)[:200]}"] += 1

    try:
        began = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - began
        where = await catalog.holders(made)
    finally:
        deleted = await asyncio.gather(*(call(endpoint.url, "DELETE", f"/api/sessions/{sid}", None, client)
                                         for sid in made))  # fmt: skip
        client.close()
    assert all(status == 204 for status, _ in deleted), deleted
    spread = {host.host_id: sum(1 for holder in where.values() if holder == host.host_id) for host in hosts}
    return {
        "wall_s": wall,
        "sessions_per_s": len(made) / wall,
        "create": stats(times) if times else None,
        "spread": spread,
        "failed": sum(failures.values()),
        "failures": dict(failures),
    }


def throughput_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The bursts of one setting: their median sessions/s, and each burst as measured."""
    return {
        "sessions_per_s": statistics.median(run["sessions_per_s"] for run in runs),
        "bursts": runs,
    }


# -- the run --------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def clusters(root: Path, capacity: int) -> AsyncIterator[tuple[dict[str, Host], Catalog, Catalog]]:
    """PostgreSQL with two catalogs, the pair (host-a, room ``capacity``; host-f, room 1) and the
    trio (host-1..3, room ``capacity`` each), all five gateways up and joined. On exit: every
    gateway stopped (its sandboxes deleted), the databases dropped, PostgreSQL stopped; a
    container left by any gateway fails the run."""
    sys.path.insert(0, str(REPO))  # tests/postgres_fixtures.py: the one way this repo runs a throwaway PostgreSQL
    from tests.postgres_fixtures import create_database, drop_database, running_postgres

    secret = root / "cluster.secret"
    secret.write_bytes(os.urandom(48).hex().encode())
    secret.chmod(0o600)
    tokens = root / "tokens.json"
    tokens.write_text(json.dumps({TENANT: TOKEN}))
    tokens.chmod(0o600)
    with running_postgres() as server:
        pair_url, trio_url = create_database(server.url()), create_database(server.url())
        hosts = {
            "host-a": Host(root, "host-a", pair_url, secret, tokens, capacity),
            "host-f": Host(root, "host-f", pair_url, secret, tokens, 1),
            **{f"host-{i}": Host(root, f"host-{i}", trio_url, secret, tokens, capacity) for i in (1, 2, 3)},
        }
        try:
            await asyncio.gather(*(host.start() for host in hosts.values()))
            pair, trio = Catalog(pair_url), Catalog(trio_url)
            await pair.settled([hosts["host-a"], hosts["host-f"]])  # both joined (they join after listening)
            await trio.settled([hosts[f"host-{i}"] for i in (1, 2, 3)])
            yield hosts, pair, trio
        finally:
            stops = await asyncio.gather(*(host.stop() for host in hosts.values()), return_exceptions=True)
            leaked = [cid for host in hosts.values() for cid in host.leftovers()]
            if leaked:
                subprocess.run(["docker", "rm", "-f", *leaked], capture_output=True, check=False)
            for url in (pair_url, trio_url):
                drop_database(url)
            errors = [err for err in stops if isinstance(err, BaseException)]
            if errors:
                raise errors[0]
            if leaked:
                raise RuntimeError(f"containers left by the bench's gateways (removed now): {leaked}")


def line(name: str, row: dict[str, Any], extra: str = "") -> str:
    return f"{name:68} {row['p50_ms']:9.2f} {row['p95_ms']:9.2f}  {extra}"


def verdict(met: bool, quick: bool) -> str:
    """A target's verdict; a --quick run's few samples on a busy machine judge nothing."""
    said = "met" if met else "MISSED"
    return f"{said} (--quick: a few samples, not the measure; judge the full run)" if quick else said


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="calls kept per contender (5 rounds more not kept)")
    parser.add_argument("--creates", type=int, default=20, help="creates kept per contender")
    parser.add_argument("--burst", type=int, default=30, help="creates at once in a throughput burst")
    parser.add_argument("--bursts", type=int, default=2, help="bursts of each setting (1 host, 3 hosts), alternated")
    parser.add_argument("--client-calls", type=int, default=2000, help="POSTs per client in the client-alone part")
    parser.add_argument("--no-stream", action="store_true", help="leave out the NDJSON streaming execute")
    parser.add_argument("--quick", action="store_true", help="a few samples, a burst of 4 (the smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.n, args.creates, args.burst, args.bursts, args.client_calls = 5, 1, 4, 1, 40
    capacity = 2 * args.burst + 10
    cpus = os.cpu_count()
    started = time.monotonic()
    phases: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="sandkernel-bench-cluster-") as tmp:
        async with clusters(Path(tmp), capacity) as (hosts, pair, trio):
            a, f = hosts["host-a"], hosts["host-f"]
            trio_hosts = [hosts[f"host-{i}"] for i in (1, 2, 3)]
            phases["start (PostgreSQL, 5 gateways)"] = time.monotonic() - started
            executes = await forwarding(a, f, args.n, not args.no_stream)
            # The GET pair apart in the JSON: "forwarding" keeps the execute rows summarize.py reads.
            hop = {name: executes.pop(name) for name in list(executes) if name.startswith(SESSION_GET)}
            phases["forwarding"] = time.monotonic() - started - sum(phases.values())
            load_then = " ".join(f"{x:.1f}" for x in os.getloadavg())  # other work on this machine skews all rows
            create = await creates(a, f, pair, args.creates)
            phases["creates"] = time.monotonic() - started - sum(phases.values())
            runs: dict[str, list[dict[str, Any]]] = {"1 host": [], "3 hosts": []}
            settings = {"1 host": (a, [a, f], pair), "3 hosts": (trio_hosts[0], trio_hosts, trio)}
            for round_number in range(args.bursts):
                order = list(settings) if round_number % 2 == 0 else list(reversed(settings))
                for name in order:
                    endpoint, members, catalog = settings[name]
                    runs[name].append(await burst(endpoint, members, catalog, args.burst))
            phases["bursts"] = time.monotonic() - started - sum(phases.values())
        phases["stop"] = time.monotonic() - started - sum(phases.values())
    client = await client_alone(args.client_calls)
    phases["client alone"] = time.monotonic() - started - sum(phases.values())
    throughput = {name: throughput_summary(r) for name, r in runs.items()}
    one, three = throughput["1 host"]["sessions_per_s"], throughput["3 hosts"]["sessions_per_s"]
    throughput["3 hosts"]["ratio_to_1_host"] = three / one
    added = executes[f"{EXECUTE}, {FORWARDED}"]["added_p50_ms"]
    paired = executes[f"{EXECUTE}, {FORWARDED}"]["paired_added_p50_ms"]
    target = {"target": "forwarding adds <= 1 ms p50 to a trivial execute", "value": added, "unit": "ms",
              "paired_value": paired, "met": added <= 1.0}  # fmt: skip
    named_row = executes[f"{EXECUTE}, {NAMED}"]
    client_target = {"target": "a direct_to_owner client through another host adds <= 1 ms p50 to a trivial execute",
                     "value": named_row["added_p50_ms"], "unit": "ms",
                     "paired_value": named_row["paired_added_p50_ms"],
                     "met": named_row["added_p50_ms"] <= 1.0}  # fmt: skip
    note = SHARED_MACHINE.format(cpus=cpus)

    print(f"{'':68} {'p50 ms':>9} {'p95 ms':>9}  ({RUNTIME}, {cpus} cores; hosts A and F, F forwards to A)")
    for name, row in {**executes, **hop, **create}.items():
        cpu = (
            f"CPU ms/call A {row['owner_cpu_ms']:.2f}, F {row['forwarder_cpu_ms']:.2f}" if "owner_cpu_ms" in row else ""
        )
        added_text = f"{row['added_p50_ms']:+.2f} ms ({row['ratio_p50']:.2f}x" if "added_p50_ms" in row else ""
        if "paired_added_p50_ms" in row:
            added_text += f"; paired {row['paired_added_p50_ms']:+.2f} ms"
        added_text += ")  " if added_text else ""
        print(line(name, row, added_text + cpu))
    print(f"\ntarget: {target['target']}: {added:+.2f} ms (median of paired differences {paired:+.2f} ms): "
          f"{verdict(target['met'], args.quick)}")  # fmt: skip
    print(f"target: {client_target['target']}: {client_target['value']:+.2f} ms (paired "
          f"{client_target['paired_value']:+.2f} ms): {verdict(client_target['met'], args.quick)}")  # fmt: skip
    print(f"load average at the end of the forwarding phase: {load_then} ({cpus} cores)")
    print("\nthe hop's client alone (in process, to one tornado server; CPU of this process):")
    for name, row in client.items():
        print(f"  {name:32} CPU {row['cpu_ms']:.3f} ms/call, wall {row['wall_ms']:.3f} ms/call")
    print(f"\ncreate throughput, bursts of {args.burst} at once through one endpoint (pool 0, {RUNTIME}):")
    for name in ("1 host", "3 hosts"):
        for run in throughput[name]["bursts"]:
            create_p50 = f"create p50 {run['create']['p50_ms']:.0f} ms" if run["create"] else "no create succeeded"
            print(f"  {name:8} {run['sessions_per_s']:6.2f} sessions/s ({run['wall_s']:.1f} s; {create_p50}; "
                  f"on {run['spread']}; {run['failed']} failed)")  # fmt: skip
            for message, count in run["failures"].items():
                print(f"      {count} x {message}")
    print(f"  median: 1 host {one:.2f}/s, 3 hosts {three:.2f}/s ({throughput['3 hosts']['ratio_to_1_host']:.2f}x)")
    print(f"  NOTE: {note}")
    failed = sum(run["failed"] for r in runs.values() for run in r)
    out = results_path("cluster.json")
    # fmt: off
    out.write_text(json.dumps({
        "runtime": RUNTIME, "cpus": cpus, "quick": args.quick, "n": args.n, "creates": args.creates,
        "burst": args.burst, "note": note,
        "load_average_after_forwarding": load_then, "forwarding": executes, "hop": hop, "client_alone": client,
        "create": create,
        "throughput": throughput,
        "targets": [target, client_target], "phases_s": phases,
    }, indent=2) + "\n")
    # fmt: on
    print(
        f"written: {out} ({time.monotonic() - started:.0f} s: "
        + ", ".join(f"{k} {v:.0f}" for k, v in phases.items())
        + ")"
    )
    if failed:
        raise SystemExit(f"{failed} create(s) of the bursts failed (see above)")


if __name__ == "__main__":
    asyncio.run(main())
