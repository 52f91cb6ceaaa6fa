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
4. The N-1 others deleted (all at once, timed), the first session alone again: the load of a
   shared machine moves, so the p99 ratio is taken against the better of the two alone runs.

The target (issue 17): trivial execute p99 with N idle <= 2x the single-session p99, and memory
per session within 10% of a bare container. ``--old-drain`` also measures the idle CPU with the
drain polling every second, as before issue 17 (a before/after in one run). ``--hold S`` keeps
the N sessions idle S seconds before measuring, for ``py-spy record -p <pid>`` from another shell
(the pid is printed).

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

import docker.errors
from inprocess_gateway import GatewayApi, inprocess_gateway
from results_dir import save_for_runtime
from throughput_density import bare_kernel_memory, memory_mib

from sandkernel.kernels.execution import drain
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


def thread_cpu_seconds() -> dict[str, float]:
    """This process's CPU seconds by thread group: the event loop (main thread), libzmq's I/O
    and reaper threads (one pair per zmq context), and every other thread (executor, jupyter_client's
    heartbeat channels, the catalog and audit writers)."""
    groups = {"event_loop": 0.0, "zmq": 0.0, "other": 0.0}
    me = os.getpid()
    for tid in os.listdir(f"/proc/{me}/task"):
        try:
            fields = Path(f"/proc/{me}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            comm = Path(f"/proc/{me}/task/{tid}/comm").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        group = "event_loop" if int(tid) == me else "zmq" if comm.startswith("ZMQbg") else "other"
        groups[group] += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return groups


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
    """Percent of one core the gateway process (this one; in all and by thread group) and dockerd
    use while nothing is asked. Threads that end meanwhile are left out of the groups."""
    docker = dockerd_pid()
    ours0, docker0 = process_cpu_seconds(os.getpid()), process_cpu_seconds(docker) if docker else None
    threads0 = thread_cpu_seconds()
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    elapsed = time.monotonic() - t0
    ours1, docker1 = process_cpu_seconds(os.getpid()), process_cpu_seconds(docker) if docker else None
    threads1 = thread_cpu_seconds()
    assert ours0 is not None and ours1 is not None
    result: dict[str, float | None] = {
        "gateway_cpu_percent": 100 * (ours1 - ours0) / elapsed,
        "dockerd_cpu_percent": 100 * (docker1 - docker0) / elapsed if docker0 is not None and docker1 else None,
    }
    for group, spent in threads1.items():
        result[f"{group}_cpu_percent"] = 100 * max(spent - threads0[group], 0.0) / elapsed
    return result


def cpu_line(idle: dict) -> str:
    return (
        f"{idle['gateway_cpu_percent']:.1f}% of a core (event loop {idle['event_loop_cpu_percent']:.1f}%, "
        f"zmq threads {idle['zmq_cpu_percent']:.1f}%, other threads {idle['other_cpu_percent']:.1f}%)"
    )


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


def bare_memory(runtime: str) -> float:
    """bare_kernel_memory, once more if its container vanished (a busy shared machine, where
    another run's cleanup may remove it: seen once, and the long run lost its numbers)."""
    try:
        return bare_kernel_memory(runtime)
    except docker.errors.NotFound:
        return bare_kernel_memory(runtime)


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
    alone = results["alone"]
    print(
        f"  alone: 1+1 p50 {alone['p50_ms']:.1f} ms, p99 {alone['p99_ms']:.1f} ms; idle {cpu_line(alone)}", flush=True
    )

    others, seconds = await create_in_batches(api, args.sessions - 1, args.batch)
    sids.extend(others)
    results["create_seconds"] = seconds
    await asyncio.sleep(args.settle)  # let the new kernels finish settling
    if args.hold:
        print(f"  holding {len(sids)} idle sessions for {args.hold:.0f} s: py-spy record -p {os.getpid()}", flush=True)
        await asyncio.sleep(args.hold)
    if args.old_drain:
        # The drain as it was before issue 17 (a poll with a 1 s timeout), for a before/after in
        # one run: the in-flight waits end within DRAIN_POLL_SECONDS of the old value being set.
        kept, drain.DRAIN_POLL_SECONDS = drain.DRAIN_POLL_SECONDS, 1.0
        await asyncio.gather(*(api.execute(sid, "1+1") for sid in sids))  # every drain waits anew
        await asyncio.sleep(2)
        results["crowd_idle_old_drain"] = await idle_cpu(args.idle_seconds)
        drain.DRAIN_POLL_SECONDS = kept
        await asyncio.sleep(2)  # the 1 s waits end and the drains wait the current way again
        print(f"  {len(sids)} idle, old drain (1 s polls): {cpu_line(results['crowd_idle_old_drain'])}", flush=True)
    crowd: dict = await idle_cpu(args.idle_seconds)
    crowd.update(process_status(os.getpid()))
    results["crowd_idle"] = crowd
    print(f"  {len(sids)} idle: {cpu_line(crowd)}; {crowd['threads']} threads", flush=True)
    results["random_session"] = percentiles(await execute_samples(api, lambda: random.choice(sids), args.samples))
    results["first_session"] = percentiles(await execute_samples(api, lambda: first, args.samples))
    memory = await container_memory(sids)
    results["idle_session_mib"] = statistics.median(memory)
    results["idle_session_mib_max"] = max(memory)
    results["memory_sampled"] = len(memory)
    # The first session alone again, after the others are deleted: on a shared machine the load
    # moves, so the ratio is taken against the better (lower) of the two alone measurements.
    t0 = time.perf_counter()
    await asyncio.gather(*(api("DELETE", f"/api/sessions/{sid}") for sid in sids if sid != first))
    results["delete_all_seconds"] = time.perf_counter() - t0
    results["alone_after"] = percentiles(await execute_samples(api, lambda: first, args.samples))
    results["ratio_p99"] = results["random_session"]["p99_ms"] / min(
        results["alone"]["p99_ms"], results["alone_after"]["p99_ms"]
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", default="runc", choices=["runc", "runsc"])
    parser.add_argument("--sessions", type=int, default=200, help="sessions alive at once (the first included)")
    parser.add_argument("--batch", type=int, default=20, help="sessions created at once")
    parser.add_argument("--samples", type=int, default=300, help="trivial executes per measurement")
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="length of each idle CPU measurement")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds the sessions idle before measuring")
    parser.add_argument("--hold", type=float, default=0.0, help="extra idle seconds, for py-spy")
    parser.add_argument(
        "--old-drain", action="store_true", help="also measure the idle CPU with the drain polling every second"
    )
    args = parser.parse_args()
    os.environ["SANDKERNEL_RUNTIME"] = args.runtime
    results: dict = {"runtime": args.runtime, "cpus": os.cpu_count(), "sessions": args.sessions}
    # The baseline first: a long run must not lose its gateway numbers to a failed baseline.
    results["bare_idle_kernel_mib"] = await asyncio.to_thread(bare_memory, args.runtime)
    print(f"  bare ipykernel container, idle: {results['bare_idle_kernel_mib']:.1f} MiB", flush=True)
    sids: list[str] = []
    started = time.perf_counter()
    try:
        room = {"max_sessions": args.sessions + 5, "max_sessions_total": args.sessions + 5}
        # default_runtime explicitly: the settings read $SANDKERNEL_RUNTIME only from the environment
        # at parse time, so the variable set above would leave "auto" (gVisor where registered).
        settings = {**room, "default_runtime": args.runtime, "idle_timeout": None, "max_lifetime": None}
        async with inprocess_gateway(**settings) as port:
            await measure(GatewayApi(port), args, results, sids)
    finally:
        if left := await asyncio.to_thread(remove_leftovers, sids):
            print(f"  removed {left} containers the gateway left behind")
    results["seconds"] = time.perf_counter() - started
    report(results)
    save_for_runtime("density.json", args.runtime, results)


def report(r: dict) -> None:
    n, alone, crowd, rand, first = r["sessions"], r["alone"], r["crowd_idle"], r["random_session"], r["first_session"]
    cpu = r["cpus"]
    print(f"density ({r['runtime']}, {cpu} cores): {n} sessions, created in {r['create_seconds']:.1f} s")
    after = r["alone_after"]
    print(
        f"  trivial execute p50 / p99: alone {alone['p50_ms']:.1f} / {alone['p99_ms']:.1f} ms before the others, "
        f"{after['p50_ms']:.1f} / {after['p99_ms']:.1f} ms after; "
        f"{n} idle, random session {rand['p50_ms']:.1f} / {rand['p99_ms']:.1f} ms "
        f"(p99 {r['ratio_p99']:.2f}x the better alone, target <= 2x); "
        f"first session {first['p50_ms']:.1f} / {first['p99_ms']:.1f} ms"
    )
    docker_alone, docker_crowd = alone["dockerd_cpu_percent"], crowd["dockerd_cpu_percent"]
    print(
        f"  idle gateway CPU: {alone['gateway_cpu_percent']:.1f}% of a core with 1 session, "
        f"{crowd['gateway_cpu_percent']:.1f}% with {n}"
        + (f"; dockerd {docker_alone:.1f}% / {docker_crowd:.1f}%" if docker_alone is not None and docker_crowd else "")
    )
    if old := r.get("crowd_idle_old_drain"):
        print(f"  with {n} idle and the drain polling every second (before issue 17): {cpu_line(old)}")
    per_session = (crowd["rss_mib"] - alone["rss_mib"]) / max(n - 1, 1)
    print(
        f"  gateway memory: {alone['rss_mib']:.0f} MiB -> {crowd['rss_mib']:.0f} MiB "
        f"({per_session:.2f} MiB per session); "
        f"threads {alone['threads']} -> {crowd['threads']}"
    )
    print(
        f"  idle memory per session {r['idle_session_mib']:.1f} MiB (median of {r['memory_sampled']}) vs "
        f"{r['bare_idle_kernel_mib']:.1f} MiB bare ({r['idle_session_mib'] / r['bare_idle_kernel_mib']:.2f}x, "
        f"target <= 1.10x); {n - 1} deleted in {r['delete_all_seconds']:.1f} s"
    )


if __name__ == "__main__":
    asyncio.run(main())
