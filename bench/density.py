"""Density: N idle sessions in one gateway, and what they cost it, in one run.

1. One session alone: the p50 / p99 of a trivial execute (``1+1``) through the session API, and
   the gateway process's CPU while that one session idles.
2. N-1 more sessions, created in batches of ``--batch`` at once (a cold start each, pool off), each
   answering one ``1+1``; then left idle.
3. With N idle: the gateway's CPU while everything idles (the host's own process: event loop,
   every thread; and the Docker daemon's, when its process is visible), the gateway's resident
   memory and thread count per session, the trivial execute's p50 / p99 on a random session each
   time and on the first session, and the idle memory of a sample of the sessions' containers
   next to a bare ipykernel container of the same image measured the same way.

The target (issue 17): trivial execute p99 with N idle <= 2x the single-session p99, and memory
per session within 10% of a bare container. ``--hold S`` keeps the N sessions idle S seconds
before measuring, for ``py-spy record -p <pid>`` from another shell (the pid is printed).

Usage: python bench/density.py [--runtime runc] [--sessions 200] [--batch 20] [--samples 300]
       python bench/density.py --sessions 5 --samples 20 --idle-seconds 2   (quick, well under a minute)
Writes bench/results/density.json (per runtime).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from inprocess_gateway import GatewayApi, inprocess_gateway
from results_dir import save_for_runtime
from throughput_density import bare_kernel_memory, memory_mib

from sandkernel.kernels.sandbox.docker_engine import default_engine

# How many session containers' memory is read (docker stats takes ~0.1 s each; a sample suffices).
MEMORY_SAMPLE = 30
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50 / p99 / max in ms; p99 by the inclusive method (with 100 samples, the 99th)."""
    ordered = sorted(samples)
    p99 = statistics.quantiles(ordered, n=100, method="inclusive")[98] if len(ordered) > 1 else ordered[0]
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": p99 * 1000,
        "max_ms": ordered[-1] * 1000,
        "n": len(ordered),
    }


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (all its threads), or None if it is not visible."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_status(pid: int) -> dict[str, float]:
    """Resident memory (MiB) and thread count of ``pid``."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "threads": int(status["Threads"])}


def dockerd_pid() -> int | None:
    try:
        out = subprocess.run(["pidof", "dockerd"], capture_output=True, text=True, check=False).stdout.split()
    except OSError:
        return None
    return int(out[0]) if out else None


async def idle_cpu(seconds: float) -> dict[str, float | None]:
    """Percent of one core the gateway process (this one) and dockerd use while nothing is asked."""
    docker = dockerd_pid()
    ours0, docker0 = process_cpu_seconds(os.getpid()), process_cpu_seconds(docker) if docker else None
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    elapsed = time.monotonic() - t0
    ours1, docker1 = process_cpu_seconds(os.getpid()), process_cpu_seconds(docker) if docker else None
    assert ours0 is not None and ours1 is not None
    return {
        "gateway_cpu_percent": 100 * (ours1 - ours0) / elapsed,
        "dockerd_cpu_percent": 100 * (docker1 - docker0) / elapsed if docker0 is not None and docker1 else None,
    }


async def execute_samples(api: GatewayApi, pick: Callable[[], str], samples: int) -> list[float]:
    """Sequential trivial executes, one at a time (nothing else is asked meanwhile)."""
    durations = []
    for _ in range(samples):
        sid = pick()
        t0 = time.perf_counter()
        reply = await api.execute(sid, "1+1")
        durations.append(time.perf_counter() - t0)
        assert reply["status"] == "ok", reply
    return durations


async def create_in_batches(api: GatewayApi, count: int, batch: int) -> tuple[list[str], float]:
    """``count`` sessions, ``batch`` at a time, each answering one ``1+1``. Returns ids and seconds."""
    sids: list[str] = []
    t0 = time.perf_counter()

    async def one() -> str:
        sid = (await api("POST", "/api/sessions"))["id"]
        sids.append(sid)  # recorded before the execute, so a failure still leaves it to clean up
        await api.execute(sid, "1+1")
        return sid

    for start in range(0, count, batch):
        await asyncio.gather(*(one() for _ in range(min(batch, count - start))))
        print(f"  {len(sids) + 1} sessions", flush=True)
    return sids, time.perf_counter() - t0


async def container_memory(sids: list[str]) -> list[float]:
    """Idle memory (MiB, usage minus inactive file cache) of up to MEMORY_SAMPLE sessions' containers."""
    wanted = set(random.sample(sids, min(len(sids), MEMORY_SAMPLE)))
    ids = [row["Id"] for row in await asyncio.to_thread(session_containers, wanted)]
    return list(await asyncio.gather(*(asyncio.to_thread(memory_mib, cid) for cid in ids)))


def session_containers(sids: set[str]) -> list[dict]:
    """The containers (docker's list rows: one call, no inspect each) of the sessions ``sids``."""
    rows = default_engine().client.api.containers(all=True, filters={"label": "sandkernel.session"})
    return [row for row in rows if (row.get("Labels") or {}).get("sandkernel.session") in sids]


def remove_leftovers(sids: list[str]) -> int:
    """Remove containers of our sessions the gateway's exit did not (an interrupted run); never others'."""
    left = session_containers(set(sids))
    for row in left:
        default_engine().client.api.remove_container(row["Id"], force=True)
    return len(left)


async def measure(api: GatewayApi, args: argparse.Namespace, results: dict, sids: list[str]) -> None:
    first = (await api("POST", "/api/sessions"))["id"]
    sids.append(first)
    await execute_samples(api, lambda: first, 10)  # warm up
    results["alone"] = percentiles(await execute_samples(api, lambda: first, args.samples))
    results["alone"].update(await idle_cpu(args.idle_seconds))
    results["alone"].update(process_status(os.getpid()))

    others, seconds = await create_in_batches(api, args.sessions - 1, args.batch)
    sids.extend(others)
    results["create_seconds"] = seconds
    await asyncio.sleep(args.settle)  # let the new kernels finish settling
    if args.hold:
        print(f"  holding {len(sids)} idle sessions for {args.hold:.0f} s: py-spy record -p {os.getpid()}", flush=True)
        await asyncio.sleep(args.hold)
    crowd: dict = await idle_cpu(args.idle_seconds)
    crowd.update(process_status(os.getpid()))
    results["crowd_idle"] = crowd
    results["random_session"] = percentiles(await execute_samples(api, lambda: random.choice(sids), args.samples))
    results["first_session"] = percentiles(await execute_samples(api, lambda: first, args.samples))
    memory = await container_memory(sids)
    results["idle_session_mib"] = statistics.median(memory)
    results["idle_session_mib_max"] = max(memory)
    results["memory_sampled"] = len(memory)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", default="runc", choices=["runc", "runsc"])
    parser.add_argument("--sessions", type=int, default=200, help="sessions alive at once (the first included)")
    parser.add_argument("--batch", type=int, default=20, help="sessions created at once")
    parser.add_argument("--samples", type=int, default=300, help="trivial executes per measurement")
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="length of each idle CPU measurement")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds the sessions idle before measuring")
    parser.add_argument("--hold", type=float, default=0.0, help="extra idle seconds, for py-spy")
    args = parser.parse_args()
    os.environ["SANDKERNEL_RUNTIME"] = args.runtime
    results: dict = {"runtime": args.runtime, "cpus": os.cpu_count(), "sessions": args.sessions}
    sids: list[str] = []
    started = time.perf_counter()
    try:
        room = {"max_sessions": args.sessions + 5, "max_sessions_total": args.sessions + 5}
        # default_runtime explicitly: the settings read $SANDKERNEL_RUNTIME only from the environment
        # at parse time, so the variable set above would leave "auto" (gVisor where registered).
        settings = {**room, "default_runtime": args.runtime, "idle_timeout": None, "max_lifetime": None}
        async with inprocess_gateway(**settings) as port:
            await measure(GatewayApi(port), args, results, sids)
            t0 = time.perf_counter()
        results["delete_all_seconds"] = time.perf_counter() - t0
    finally:
        if left := await asyncio.to_thread(remove_leftovers, sids):
            print(f"  removed {left} containers the gateway left behind")
    results["bare_idle_kernel_mib"] = await asyncio.to_thread(bare_kernel_memory, args.runtime)
    results["seconds"] = time.perf_counter() - started
    report(results)
    save_for_runtime("density.json", args.runtime, results)


def report(r: dict) -> None:
    n, alone, crowd, rand, first = r["sessions"], r["alone"], r["crowd_idle"], r["random_session"], r["first_session"]
    cpu = r["cpus"]
    print(f"density ({r['runtime']}, {cpu} cores): {n} sessions, created in {r['create_seconds']:.1f} s")
    print(
        f"  trivial execute p50 / p99: alone {alone['p50_ms']:.1f} / {alone['p99_ms']:.1f} ms; "
        f"{n} idle, random session {rand['p50_ms']:.1f} / {rand['p99_ms']:.1f} ms "
        f"(p99 {rand['p99_ms'] / alone['p99_ms']:.2f}x, target <= 2x); "
        f"first session {first['p50_ms']:.1f} / {first['p99_ms']:.1f} ms"
    )
    docker_alone, docker_crowd = alone["dockerd_cpu_percent"], crowd["dockerd_cpu_percent"]
    print(
        f"  idle gateway CPU: {alone['gateway_cpu_percent']:.1f}% of a core with 1 session, "
        f"{crowd['gateway_cpu_percent']:.1f}% with {n}"
        + (f"; dockerd {docker_alone:.1f}% / {docker_crowd:.1f}%" if docker_alone is not None and docker_crowd else "")
    )
    per_session = (crowd["rss_mib"] - alone["rss_mib"]) / max(n - 1, 1)
    print(
        f"  gateway memory: {alone['rss_mib']:.0f} MiB -> {crowd['rss_mib']:.0f} MiB "
        f"({per_session:.2f} MiB per session); "
        f"threads {alone['threads']} -> {crowd['threads']}"
    )
    print(
        f"  idle memory per session {r['idle_session_mib']:.1f} MiB (median of {r['memory_sampled']}) vs "
        f"{r['bare_idle_kernel_mib']:.1f} MiB bare ({r['idle_session_mib'] / r['bare_idle_kernel_mib']:.2f}x, "
        f"target <= 1.10x); all deleted in {r['delete_all_seconds']:.1f} s"
    )


if __name__ == "__main__":
    asyncio.run(main())
