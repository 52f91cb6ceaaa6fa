"""Throughput, density and output, through the gateway's session API, in one run:

- throughput: sequential executes/s on one session; total executes/s with 10 and --sessions
  concurrent sessions, each executing in a loop;
- density: time to start --sessions sessions at once, and memory per idle session next to a bare
  ipykernel container of the same image (no gateway, no hardening) measured the same way;
- output: time to return 10 MB of printed output (budgeted reply) and a 1 MB PNG, next to raw
  jupyter_client receiving the same from a sandkernel kernel.

Usage: python bench/throughput_density.py [--runtime runc] [--sessions 50] [--seconds 5] [--sequential 200]
       [--settle 10]
Writes bench/results/throughput_density.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from cold_start import bare_sockets_ready, remove_bare_kernel, start_bare_kernel
from inprocess_gateway import GatewayApi, inprocess_gateway
from results_dir import results_path

from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.reaper import listed_containers
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import SESSION_LABEL

TEN_MB = "print('x' * 10_000_000)"
ONE_MB_PNG = (
    "import os\nfrom IPython.display import Image, display\n"
    "display(Image(data=b'\\x89PNG\\r\\n\\x1a\\n' + os.urandom(2**20), format='png'))"
)


async def executes_per_second(api: GatewayApi, sids: list[str], seconds: float) -> float:
    done = 0
    deadline = time.monotonic() + seconds

    async def loop(sid: str) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            await api.execute(sid, "1+1")
            done += 1

    started = time.monotonic()
    await asyncio.gather(*(loop(sid) for sid in sids))
    return done / (time.monotonic() - started)


def memory_mib(container_id: str) -> float:
    stats = default_engine().client.api.stats(container_id, stream=False, one_shot=True)
    usage = stats["memory_stats"].get("usage", 0)
    cache = stats["memory_stats"].get("stats", {}).get("inactive_file", 0)
    return (usage - cache) / 2**20


def bare_kernel_memory(runtime: str) -> float:
    """An idle ipykernel in a bare container of the same image: the density baseline."""
    container, rundir, _ = start_bare_kernel(runtime, "bench-density")
    try:
        deadline = time.monotonic() + 60
        while not bare_sockets_ready(rundir) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(3)  # settle, as the sandkernel sessions have
        return memory_mib(container.id)
    finally:
        remove_bare_kernel(container, rundir)


async def raw_output_seconds(code: str, repeats: int) -> float:
    async with await KernelSession.start() as session:
        client = session.kernel_manager.client()
        client.start_channels()
        await client.wait_for_ready(timeout=60)
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await client.execute_interactive(code, timeout=120, output_hook=lambda m: None)
            samples.append(time.perf_counter() - t0)
        client.stop_channels()
        return statistics.median(samples)


async def measure_gateway(api: GatewayApi, args: argparse.Namespace, results: dict) -> None:
    first = (await api("POST", "/api/sessions"))["id"]
    await api.execute(first, "1+1")
    t0 = time.perf_counter()
    for _ in range(args.sequential):
        await api.execute(first, "1+1")
    results["sequential_executes_per_s"] = args.sequential / (time.perf_counter() - t0)
    results["output_10mb_ms"] = (
        statistics.median([await timed(api.execute(first, TEN_MB)) for _ in range(args.repeats)]) * 1000
    )
    results["output_1mb_png_ms"] = (
        statistics.median([await timed(api.execute(first, ONE_MB_PNG)) for _ in range(args.repeats)]) * 1000
    )
    started = time.perf_counter()
    created = await asyncio.gather(*(api("POST", "/api/sessions") for _ in range(args.sessions - 1)))
    results["start_all_seconds"] = time.perf_counter() - started
    sids = [first] + [s["id"] for s in created]
    await asyncio.gather(*(api.execute(sid, "1+1") for sid in sids))
    await asyncio.sleep(args.settle)  # let every new kernel finish settling before measuring
    session_memory = [
        memory_mib(c.id) for c in listed_containers(default_engine()) if c.labels.get(SESSION_LABEL) in set(sids)
    ]
    results["idle_session_mib"] = statistics.median(session_memory)
    results["executes_per_s_10_sessions"] = await executes_per_second(api, sids[:10], args.seconds)
    results[f"executes_per_s_{args.sessions}_sessions"] = await executes_per_second(api, sids, args.seconds)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", default="runc", choices=["runc", "runsc"])
    parser.add_argument("--sessions", type=int, default=50, help="concurrent sessions for density and throughput")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each throughput run")
    parser.add_argument("--repeats", type=int, default=5, help="samples of each output measurement")
    parser.add_argument("--sequential", type=int, default=200, help="executes of the sequential throughput run")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds new kernels settle before memory is read")
    args = parser.parse_args()
    os.environ["SANDKERNEL_RUNTIME"] = args.runtime
    results: dict = {"runtime": args.runtime, "cpus": os.cpu_count(), "sessions": args.sessions}
    async with inprocess_gateway(
        max_sessions=args.sessions + 5, max_sessions_total=args.sessions + 5, default_runtime=args.runtime
    ) as port:
        await measure_gateway(GatewayApi(port), args, results)
    results["bare_idle_kernel_mib"] = await asyncio.to_thread(bare_kernel_memory, args.runtime)
    results["raw_output_10mb_ms"] = await raw_output_seconds(TEN_MB, args.repeats) * 1000
    results["raw_output_1mb_png_ms"] = await raw_output_seconds(ONE_MB_PNG, args.repeats) * 1000
    print(f"throughput, density and output ({args.runtime}, {os.cpu_count()} cores)")
    print(f"  sequential executes on one session: {results['sequential_executes_per_s']:.0f}/s")
    print(
        f"  concurrent executes, 10 sessions: {results['executes_per_s_10_sessions']:.0f}/s; "
        f"{args.sessions} sessions: {results[f'executes_per_s_{args.sessions}_sessions']:.0f}/s"
    )
    print(
        f"  {args.sessions} sessions started at once in {results['start_all_seconds']:.1f} s; idle memory "
        f"{results['idle_session_mib']:.1f} MiB per session vs {results['bare_idle_kernel_mib']:.1f} MiB bare "
        f"({results['idle_session_mib'] / results['bare_idle_kernel_mib']:.2f}x)"
    )
    print(
        f"  10 MB printed: {results['output_10mb_ms']:.0f} ms "
        f"(raw jupyter_client {results['raw_output_10mb_ms']:.0f} ms); "
        f"1 MB PNG: {results['output_1mb_png_ms']:.0f} ms (raw {results['raw_output_1mb_png_ms']:.0f} ms)"
    )
    out = results_path("throughput_density.json")
    data = json.loads(out.read_text()) if out.exists() else {}
    data[args.runtime] = results
    out.write_text(json.dumps(data, indent=2) + "\n")


async def timed(awaitable) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    await awaitable
    return time.perf_counter() - t0


if __name__ == "__main__":
    asyncio.run(main())
