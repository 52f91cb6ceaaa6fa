"""Time to interactive, the way the public sandbox benchmarks measure it (ComputeSDK's daily one:
create → first command): session create → the first cell's result, through the gateway's session
API, for ``1+1`` and for an agent's usual first cell (``import pandas as pd, io`` +
``pd.read_csv`` of a small CSV + ``df.shape``).

Arrival patterns (``--modes``): sequential (one after another; each pooled sample waits for the
pool to be full again, so it measures the acquire path, not the refill), staggered (one arrival
every ``--interval`` seconds, each on its own) and burst (all ``--n`` at once). Contenders, all in
the same run and with the same arrival pattern:

- ``pool + preload``: a warm pool sized for the run (``pool_size`` = n, and ``pool_max`` = n
  where the gateway has that setting) with the default ``pool_preload`` (numpy, pandas,
  matplotlib.pyplot), full before each run;
- ``pool without preload``: the same pool with ``pool_preload`` empty (pandas cell only: it shows
  what the preload buys);
- ``pool off``: every session a cold start;
- ``bare docker run``: the baseline, a bare ``docker run`` of the same image with ipykernel,
  reached with raw jupyter_client (no gateway, no hardening; bench/cold_start.py's), its
  ``docker run`` calls on a thread each so a burst is as concurrent as the engine allows.

References in the same run, on one sandkernel kernel with raw jupyter_client: one execute round
trip of ``1+1``, a freshly started kernel's first pandas cell and a warm kernel's pandas cell.
Prints p50 / p95 / p99 of each beside its baseline, then the issue's targets (#17) met or missed;
writes bench/results/time_to_interactive.json (one entry per runtime).

Usage: python bench/time_to_interactive.py [--runtime runc] [--n 100] [--modes sequential,staggered,burst]
       [--interval 0.2] [--references 50]
The in-process gateway shares the benchmark's event loop and its HTTP client; sessions of a
staggered or burst run are deleted once the whole run is measured, a sequential one's after each.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import docker.errors
from cold_start import bare_sockets_ready, remove_bare_kernel, start_bare_kernel
from inprocess_gateway import GatewayApi, inprocess_gateway
from jupyter_client import AsyncKernelClient
from results_dir import results_path, save_for_runtime
from tornado.httpclient import HTTPClientError

from sandkernel.gateway.settings import GatewaySettings
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.logs import configure

CSV = "city,year,sales\n" + "".join(f"c{i % 7},{2000 + i % 20},{i * 37 % 1000}\n" for i in range(40))
PANDAS = f"import pandas as pd, io\ndf = pd.read_csv(io.StringIO({CSV!r}))\ndf.shape"
CELLS = {"1+1": ("1+1", "2"), "pandas read_csv": (PANDAS, "(40, 3)")}
MODES = ("sequential", "staggered", "burst")
BARE, COLD, POOL, POOL_BARE = "bare docker run", "pool off", "pool + preload", "pool without preload"
CONTENDERS = {BARE: tuple(CELLS), COLD: tuple(CELLS), POOL: tuple(CELLS), POOL_BARE: ("pandas read_csv",)}
SETTINGS_FIELDS = {field.name for field in dataclasses.fields(GatewaySettings)}


@dataclasses.dataclass
class Sample:
    total: float  # create → first result, seconds
    create: float  # create (session API: the POST; bare: docker run → kernel ready)
    cell: float  # the first cell alone


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50 / p95 / p99 in ms (nearest rank: with n=100, p99 is the second slowest)."""
    ordered = sorted(samples)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000

    return {"p50_ms": statistics.median(ordered) * 1000, "p95_ms": rank(0.95), "p99_ms": rank(0.99)}


def summarise(samples: list[Sample], failed: list[str], **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"n": len(samples), "failed": len(failed)}
    if samples:
        row.update(percentiles([s.total for s in samples]))
        row["create_p50_ms"] = statistics.median(s.create for s in samples) * 1000
        row["cell_p50_ms"] = statistics.median(s.cell for s in samples) * 1000
    if failed:
        row["errors"] = sorted(set(failed))[:5]
    return {**row, **extra}


async def arrive(
    mode: str, n: int, interval: float, one: Callable[[], Awaitable[Sample]], before_each: Callable[[], Awaitable[None]]
) -> tuple[list[Sample], list[str]]:
    """Run ``one`` n times in the arrival pattern; the samples and the errors (a failed create
    is counted, not fatal: a gateway that refuses part of a burst shows it in the table)."""
    outcomes: list[Sample | BaseException] = []
    if mode == "sequential":
        for _ in range(n):
            await before_each()
            try:
                outcomes.append(await one())
            except Exception as err:  # recorded in the table
                outcomes.append(err)
    else:
        began = time.perf_counter()

        async def at(i: int) -> Sample:
            await asyncio.sleep(max(0.0, began + i * interval - time.perf_counter()))
            return await one()

        delays = range(n) if mode == "staggered" else [0] * n
        outcomes = await asyncio.gather(*(at(i) for i in delays), return_exceptions=True)
    samples = [o for o in outcomes if isinstance(o, Sample)]
    return samples, [describe(o) for o in outcomes if not isinstance(o, Sample)]


def describe(err: BaseException) -> str:
    if isinstance(err, HTTPClientError) and err.response is not None:
        return f"HTTP {err.code}: {err.response.body[:200].decode(errors='replace')}"
    return f"{type(err).__name__}: {err}"[:200]


def result_text(outputs: list[dict]) -> str | None:
    return next((o["data"].get("text/plain") for o in outputs if o.get("output_type") == "execute_result"), None)


# -- the gateway contenders -------------------------------------------------------------------


async def gateway_runs(runtime: str, contender: str, n: int, modes: list[str], interval: float) -> dict:
    """Every (mode, cell) run of one gateway contender: {mode: {cell: row}}."""
    pool = 0 if contender == COLD else n
    options: dict[str, Any] = {
        "default_runtime": runtime,
        "pool_size": pool,
        "max_sessions": n + 5,
        "max_sessions_total": 3 * n + 10,  # the pool is reserved within it; a refill may run meanwhile
    }
    if "tenant_start_concurrency" in SETTINGS_FIELDS:  # one tenant's burst: the start path, not the fair share
        options["tenant_start_concurrency"] = 1024
    if pool and "pool_max" in SETTINGS_FIELDS:
        options["pool_max"] = pool  # demand-following pool (issue 17): its ceiling is the run's size
    if contender == POOL_BARE:
        options["pool_preload"] = ()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="skb-tti-") as audit_dir:
        options["audit_dir"] = Path(audit_dir)  # its session_created records say which came from the pool
        async with gateway(options) as port:
            api = GatewayApi(port)

            async def pool_full() -> None:
                if not pool:
                    return
                deadline = time.monotonic() + 120 + 60 * pool
                while (await api("GET", "/api/health"))["warm_pool"] < pool:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the warm pool did not fill to {pool} ({contender}, {runtime})")
                    await asyncio.sleep(0.1)

            for mode in modes:
                for cell in CONTENDERS[contender]:
                    created: list[str] = []
                    checks: dict[str, Any] = {"preloaded": 0, "second cell": []}

                    async def one(
                        mode: str = mode,
                        cell: str = cell,
                        created: list[str] = created,
                        checks: dict[str, Any] = checks,
                    ) -> Sample:
                        code, expected = CELLS[cell]
                        t0 = time.perf_counter()
                        sid = (await api("POST", "/api/sessions", {}))["id"]
                        created.append(sid)
                        t1 = time.perf_counter()
                        reply = await api.execute(sid, code)
                        t2 = time.perf_counter()
                        if reply.get("status") != "ok" or result_text(reply["outputs"]) != expected:
                            raise RuntimeError(f"unexpected reply: {json.dumps(reply)[:300]}")
                        if mode == "sequential":
                            # Not in the sample: was the data stack there before the user imported
                            # it, and what does a second trivial cell cost (the first one's extra)?
                            if cell == "1+1":
                                t3 = time.perf_counter()
                                probe = await api.execute(sid, "'pandas' in __import__('sys').modules")
                                checks["second cell"].append(time.perf_counter() - t3)
                                checks["preloaded"] += result_text(probe["outputs"]) == "True"
                            await api("DELETE", f"/api/sessions/{sid}")
                            created.remove(sid)
                        return Sample(t2 - t0, t1 - t0, t2 - t1)

                    await pool_full()
                    seen = len(pool_handouts(Path(audit_dir)))
                    samples, failed = await arrive(mode, n, interval, one, pool_full if mode == "sequential" else idle)
                    await asyncio.gather(*(api("DELETE", f"/api/sessions/{sid}") for sid in created))
                    extra: dict[str, Any] = {}
                    if checks["second cell"]:
                        extra["second_cell_p50_ms"] = statistics.median(checks["second cell"]) * 1000
                    if pool:
                        handouts = pool_handouts(Path(audit_dir))[seen:]
                        extra["from_pool"] = sum(handouts)
                        if mode == "sequential" and cell == "1+1":
                            extra["pandas_already_imported"] = checks["preloaded"]
                    results.setdefault(mode, {})[cell] = summarise(samples, failed, **extra)
                    show(runtime, mode, cell, contender, results[mode][cell])
    return results


@contextlib.asynccontextmanager
async def gateway(options: dict[str, Any], attempts: int = 3) -> AsyncIterator[int]:
    """``inprocess_gateway``, its start tried again when Docker loses a container under the
    start-up reaper's listing (other gateways on a busy machine remove theirs meanwhile)."""
    for attempt in range(1, attempts + 1):
        stack = contextlib.AsyncExitStack()
        try:
            port = await stack.enter_async_context(inprocess_gateway(**options))
        except docker.errors.NotFound as err:
            if attempt == attempts:
                raise
            print(f"  (the gateway's start-up reap lost a container, trying again: {err})")
            continue
        async with stack:
            yield port
        return


async def idle() -> None:
    """Nothing to wait for between arrivals (staggered and burst runs)."""


def pool_handouts(audit_dir: Path) -> list[bool]:
    """For each session created so far, in order, whether the warm pool served it (the audit
    stream's ``session_created`` records; written as they happen)."""
    path = audit_dir / "audit.jsonl"
    if not path.exists():
        return []
    records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return [bool(find_key(r, "warm_pool")) for r in records if "session_created" in json.dumps(r)]


def find_key(record: Any, key: str) -> Any:
    """A key anywhere in an audit record (its fields may be nested under the event)."""
    if isinstance(record, dict):
        if key in record:
            return record[key]
        for value in record.values():
            found = find_key(value, key)
            if found is not None:
                return found
    return None


# -- the baseline: bare docker run + ipykernel -------------------------------------------------


async def bare_runs(runtime: str, n: int, modes: list[str], interval: float) -> dict:
    results: dict[str, dict] = {}
    for mode in modes:
        for cell in CONTENDERS[BARE]:
            started: list[tuple[object, Path, AsyncKernelClient]] = []
            # A thread per container: the burst is as concurrent as the Docker engine lets it be.
            with concurrent.futures.ThreadPoolExecutor(max_workers=n) as threads:

                async def one(
                    mode: str = mode,
                    cell: str = cell,
                    started: list[tuple[object, Path, AsyncKernelClient]] = started,
                    threads: concurrent.futures.Executor = threads,
                ) -> Sample:
                    code, expected = CELLS[cell]
                    loop = asyncio.get_running_loop()
                    t0 = time.perf_counter()
                    container, rundir, info = await loop.run_in_executor(
                        threads, start_bare_kernel, runtime, "bench-time-to-interactive"
                    )
                    client = AsyncKernelClient()
                    started.append((container, rundir, client))
                    client.load_connection_info(dict(info, ip=str(rundir / "k")))
                    deadline = time.monotonic() + 120
                    while not bare_sockets_ready(rundir):
                        if time.monotonic() > deadline:
                            raise RuntimeError("a bare kernel did not start")
                        await asyncio.sleep(0.005)
                    client.start_channels()
                    await client.wait_for_ready(timeout=120)
                    t1 = time.perf_counter()
                    text = await raw_execute(client, code)
                    t2 = time.perf_counter()
                    if text != expected:
                        raise RuntimeError(f"unexpected result {text!r}")
                    if mode == "sequential":
                        await remove_bare(started.pop(), threads)
                    return Sample(t2 - t0, t1 - t0, t2 - t1)

                samples, failed = await arrive(mode, n, interval, one, idle)
                await asyncio.gather(*(remove_bare(entry, threads) for entry in started))
            results.setdefault(mode, {})[cell] = summarise(samples, failed)
            show(runtime, mode, cell, BARE, results[mode][cell])
    return results


async def remove_bare(entry: tuple[object, Path, AsyncKernelClient], threads: concurrent.futures.Executor) -> None:
    """Remove a bare kernel; one already gone is fine (a gateway starting elsewhere on the machine
    reaps unowned sandkernel containers, and the bare ones carry no owner)."""
    container, rundir, client = entry
    client.stop_channels()
    try:
        await asyncio.get_running_loop().run_in_executor(threads, remove_bare_kernel, container, rundir)
    except docker.errors.NotFound:
        shutil.rmtree(rundir, ignore_errors=True)


async def raw_execute(client: AsyncKernelClient, code: str) -> str | None:
    """One execute through raw jupyter_client; the execute_result's text."""
    outputs: list[dict] = []

    def hook(msg: dict) -> None:
        if msg["msg_type"] == "execute_result":
            outputs.append({"output_type": "execute_result", "data": msg["content"]["data"]})

    reply = await client.execute_interactive(code, timeout=120, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"execute failed: {reply['content']}")
    return result_text(outputs)


# -- references on one sandkernel kernel, raw jupyter_client ----------------------------------


async def references(runtime: str, k: int) -> dict[str, Any]:
    """One raw execute round trip, a fresh kernel's first pandas cell, a warm kernel's pandas cell."""
    async with await KernelSession.start(overrides={"runtime": runtime}) as session:
        client = session.kernel_manager.client()
        client.start_channels()
        await client.wait_for_ready(timeout=120)
        try:
            t0 = time.perf_counter()
            await raw_execute(client, PANDAS)
            first_pandas = time.perf_counter() - t0
            rows: dict[str, list[float]] = {"raw execute 1+1": [], "warm kernel pandas cell": []}
            for i in range(k + 5):
                for name, code in (("raw execute 1+1", "1+1"), ("warm kernel pandas cell", PANDAS)):
                    t0 = time.perf_counter()
                    await raw_execute(client, code)
                    if i >= 5:  # warm-up
                        rows[name].append(time.perf_counter() - t0)
        finally:
            client.stop_channels()
    found: dict[str, Any] = {name: {"n": len(v), **percentiles(v)} for name, v in rows.items()}
    found["fresh kernel's first pandas cell"] = {"n": 1, "p50_ms": first_pandas * 1000}
    return found


# -- report ------------------------------------------------------------------------------------


def show(runtime: str, mode: str, cell: str, contender: str, row: dict) -> None:
    if "p50_ms" not in row:
        print(f"  {runtime:5} {mode:10} {cell:15} {contender:20} all {row['failed']} failed: {row.get('errors')}")
        return
    pool = f"  from pool {row['from_pool']}/{row['n']}" if "from_pool" in row else ""
    failed = f"  FAILED {row['failed']}: {row['errors'][0]}" if row["failed"] else ""
    print(
        f"  {runtime:5} {mode:10} {cell:15} {contender:20} p50 {row['p50_ms']:8.1f}  p95 {row['p95_ms']:8.1f}  "
        f"p99 {row['p99_ms']:8.1f} ms  (create {row['create_p50_ms']:.1f} + cell {row['cell_p50_ms']:.1f})"
        f"{pool}{failed}"
    )


def p50(runs: dict, mode: str, cell: str, contender: str) -> float | None:
    return runs.get(contender, {}).get(mode, {}).get(cell, {}).get("p50_ms")


def targets(runtime: str, n: int, runs: dict, refs: dict) -> list[dict[str, Any]]:
    """The issue's targets (#17) that this run measures, each with its value and verdict."""
    found = []

    def target(name: str, value: float | None, limit: float, unit: str, *, at_least: bool = False) -> None:
        if value is None:
            return
        met = value >= limit if at_least else value <= limit
        found.append({"target": name, "value": value, "limit": limit, "unit": unit, "met": met})

    warm_pandas = p50(runs, "sequential", "pandas read_csv", POOL)
    if runtime == "runc":
        target("warm pool -> first pandas read_csv result, p50 <= 50 ms", warm_pandas, 50, "ms")
    cold = runs.get(COLD, {}).get("sequential", {}).get("pandas read_csv", {}).get("cell_p50_ms")
    if warm_pandas and cold:
        target(
            "a cold sandbox's first pandas cell / warm pool -> first pandas result, p50 >= 10x",
            cold / warm_pandas,
            10,
            "x",
            at_least=True,
        )
    bare_burst, cold_burst, pool_burst = (p50(runs, "burst", "1+1", c) for c in (BARE, COLD, POOL))
    if bare_burst and cold_burst:
        target(f"burst of {n}, pool off / bare docker run burst, p50 <= 1.1x", cold_burst / bare_burst, 1.1, "x")
    if bare_burst and pool_burst:
        target(
            f"burst of {n}, bare docker run burst / pool sized for it, p50 >= 5x",
            bare_burst / pool_burst,
            5,
            "x",
            at_least=True,
        )
    warm_trivial = p50(runs, "sequential", "1+1", POOL)
    if warm_trivial:
        raw = refs["raw execute 1+1"]["p50_ms"]
        target("warm acquire -> 1+1 / one raw execute round trip, p50 <= 2x", warm_trivial / raw, 2, "x")
    return found


def report(runtime: str, n: int, runs: dict, refs: dict, verdicts: list[dict]) -> None:
    print(f"\ntime to interactive, {runtime}, n={n}: p50 / p95 / p99 ms, and p50 against bare docker run")
    print(f"  {'mode':10} {'cell':15} {'contender':20} {'p50':>8} {'p95':>8} {'p99':>8} {'vs bare':>8}  notes")
    for mode in MODES:
        for cell in CELLS:
            bare = p50(runs, mode, cell, BARE)
            for contender in CONTENDERS:
                row = runs.get(contender, {}).get(mode, {}).get(cell)
                if row is None:
                    continue
                if "p50_ms" not in row:
                    print(f"  {mode:10} {cell:15} {contender:20} all {row['failed']} failed")
                    continue
                ratio = f"{row['p50_ms'] / bare:7.2f}x" if bare and contender != BARE else " " * 8
                notes = [f"from pool {row['from_pool']}/{row['n']}"] if "from_pool" in row else []
                if "second_cell_p50_ms" in row:
                    notes.append(f"cell {row['cell_p50_ms']:.1f}, a second one {row['second_cell_p50_ms']:.1f}")
                if "pandas_already_imported" in row:
                    notes.append(f"pandas imported before the first cell {row['pandas_already_imported']}/{row['n']}")
                if row["failed"]:
                    notes.append(f"{row['failed']} failed")
                print(
                    f"  {mode:10} {cell:15} {contender:20} {row['p50_ms']:8.1f} {row['p95_ms']:8.1f} "
                    f"{row['p99_ms']:8.1f} {ratio}  {', '.join(notes)}"
                )
    print("  references (one sandkernel kernel, raw jupyter_client, same run):")
    for name, row in refs.items():
        print(f"    {name:32} p50 {row['p50_ms']:8.1f} ms  (n={row['n']})")
    print("  targets (issue 17):")
    for t in verdicts:
        value = f"{t['value']:.1f} ms" if t["unit"] == "ms" else f"{t['value']:.2f}x"
        print(f"    {'met   ' if t['met'] else 'MISSED'} {t['target']}: {value}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", default="runc", choices=["runc", "runsc"])
    parser.add_argument("--n", type=int, default=100, help="sessions per mode, cell and contender")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: sequential, staggered, burst")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between staggered arrivals")
    parser.add_argument("--references", type=int, default=50, help="samples of each reference")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset (default: all)")
    # (the contenders' names hold no comma)
    args = parser.parse_args()
    contenders = [c for c in args.contenders.split(",") if c]
    if not contenders or set(contenders) - set(CONTENDERS):
        parser.error(f"--contenders: a comma-separated subset of {', '.join(CONTENDERS)}")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes: a comma-separated subset of {', '.join(MODES)}")
    configure("WARNING")  # the gateways' per-request and per-session lines would bury the table
    began = time.monotonic()
    print(f"time to interactive, {args.runtime}, n={args.n}, modes {', '.join(modes)}, interval {args.interval}s")
    runs: dict[str, dict] = {}
    if BARE in contenders:  # first: a gateway starting would reap its (unowned) containers
        runs[BARE] = await bare_runs(args.runtime, args.n, modes, args.interval)
    for contender in (COLD, POOL, POOL_BARE):
        if contender in contenders:
            runs[contender] = await gateway_runs(args.runtime, contender, args.n, modes, args.interval)
    refs = await references(args.runtime, args.references)
    verdicts = targets(args.runtime, args.n, runs, refs)
    report(args.runtime, args.n, runs, refs, verdicts)
    elapsed = time.monotonic() - began
    print(f"\n({elapsed:.0f} s; written: {results_path('time_to_interactive.json')})")
    save_for_runtime(
        "time_to_interactive.json",
        args.runtime,
        {
            "n": args.n,
            "modes": modes,
            "interval_s": args.interval,
            "pool_max_setting": "pool_max" in SETTINGS_FIELDS,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
            "seconds": round(elapsed, 1),
            "runs": runs,
            "references": refs,
            "targets": verdicts,
        },
    )


if __name__ == "__main__":
    asyncio.run(main())
