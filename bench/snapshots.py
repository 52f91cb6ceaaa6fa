"""Pause, resume and fork of a session holding N MB, through the session API and the Python
client, against what they replace: a cold start plus re-running the same cells, in the same run.

The state an agent would have built: cell 1 writes N MB of seeded random numbers to
/workspace/data.npy (its input file), cell 2 loads them into the kernel (N MB of memory), cell 3
prints a checksum (a deterministic output, so a replay can be judged ``same``). Per runtime and
size, each repeat:

- baseline: create a session and run the three cells (cold start + cells); this is the parent
- pause: the parent to disk (its files archived, its container gone)
- resume: explicit; the reply must say how (``restored_by``) and every cell's verdict; the
  checksum is checked afterwards, untimed
- fork of k: k sessions with the parent's state; baseline for it: k sessions created and given
  the same cells concurrently (what an agent would do without fork)

Everything goes through one ``sandkernel serve`` process (runc and runsc sessions side by side,
the runtime asked per session). Prints medians per row and the ratio to its baseline, timed at
the client; in brackets the gateway's own ``seconds``: the whole pause, and for a resume or a fork
only the rebuild (files put back and cells re-run, not the new sandbox's start). Writes
bench/results/snapshots.json, one entry per runtime. Targets (issue 16, with a memory checkpoint):
pause <= 1 s and resume <= 0.5 s for 200 MB, fork of 10 <= 3 s; where the gateway restores by
replay, a resume costs about what the baseline does, which the ratios show.
With ``--memory-snapshots on`` the gateway keeps gVisor kernels' memory (``restored_by:
"checkpoint"``, docs/snapshots.md); its results are saved under the runtime name ``runsc+memory``.
Usage: python bench/snapshots.py [--repeats 3] [--sizes 50,200] [--large] [--forks 3]
                                 [--runtime runc] [--runtime runsc] [--memory-snapshots on]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from results_dir import save_for_runtime
from served import served_gateway

from sandkernel.agent.client import AsyncSandkernel, AsyncSession

T = TypeVar("T")
LARGE_MB = 1024
BASELINE = "cold start + cells"


def cells(size_mb: int) -> list[str]:
    """The cells that build a session holding ``size_mb`` MB on disk and as much in memory."""
    count = size_mb * 1024 * 1024 // 8  # float64s
    return [
        f"import numpy as np\nnp.save('data.npy', np.random.default_rng(16).random({count}))",
        "data = np.load('data.npy')\ndata.nbytes",
        "checksum = round(float(data[::4096].sum()), 6)\nchecksum",
    ]


def limits_for(runtime: str, size_mb: int) -> dict[str, Any]:
    """Room for the state twice over (numpy's temporaries), within the built-in ceilings, and a
    largest-file limit above the data file (``size_mb`` MiB plus numpy's header): at the default
    1024 MiB the 1 GiB row's ``np.save`` stopped at the limit with a short write."""
    return {
        "runtime": runtime,
        "memory_mb": min(4096, max(1024, 3 * size_mb + 512)),
        "workspace_mb": min(8192, max(1024, 2 * size_mb + 256)),
        "fsize_mb": max(1024, size_mb + 64),
    }


async def timed(call: Callable[[], Awaitable[T]]) -> tuple[float, T]:
    began = time.perf_counter()
    result = await call()
    return time.perf_counter() - began, result


async def cold_session(client: AsyncSandkernel, runtime: str, size_mb: int) -> AsyncSession:
    """Cold start + the cells: the baseline, and how every parent is made."""
    session = await client.create_session(limits=limits_for(runtime, size_mb))
    for code in cells(size_mb):
        await session.run(code, check=True)
    return session


async def checksum_of(session: AsyncSession) -> str:
    return (await session.run("checksum", check=True)).text.strip()


def verdicts(reply: dict[str, Any]) -> list[str]:
    return [cell["verdict"] for cell in reply.get("cells") or []]


async def measure(client: AsyncSandkernel, runtime: str, size_mb: int, forks: int, repeats: int) -> dict[str, Any]:
    fork, fork_base = f"fork of {forks}", f"{forks} x {BASELINE}"
    rows: dict[str, list[float]] = {name: [] for name in (BASELINE, "pause", "resume", fork, fork_base)}
    server: dict[str, list[float]] = {"pause": [], "resume": [], fork: []}
    seen: dict[str, Any] = {"restored_by": set(), "verdicts": set(), "snapshot_bytes": []}
    for repeat in range(repeats):
        took, parent = await timed(lambda: cold_session(client, runtime, size_mb))
        rows[BASELINE].append(took)
        expected = await checksum_of(parent)
        try:
            took, paused = await timed(parent.pause)
            rows["pause"].append(took)
            server["pause"].append(paused["seconds"])
            seen["snapshot_bytes"].append(paused["snapshot"]["bytes"])
            took, resumed = await timed(parent.resume)
            rows["resume"].append(took)
            server["resume"].append(resumed["seconds"])
            seen["restored_by"].add(resumed["restored_by"])
            seen["verdicts"].update(verdicts(resumed))
            if await checksum_of(parent) != expected:
                raise AssertionError(f"{runtime} {size_mb} MB: the resumed session lost its data")
            took, children = await timed(functools.partial(parent.fork, forks))
            rows[fork].append(took)
            server[fork].append(max(child.restore["seconds"] for child in children))
            try:
                for child in children:
                    seen["restored_by"].add(child.restore["restored_by"])
                    seen["verdicts"].update(verdicts(child.restore))
                    if await checksum_of(child) != expected:
                        raise AssertionError(f"{runtime} {size_mb} MB: a fork lost its data")
            finally:
                await asyncio.gather(*(child.delete() for child in children))
        finally:
            await parent.delete()
        took, fresh = await timed(
            lambda: asyncio.gather(*(cold_session(client, runtime, size_mb) for _ in range(forks)))
        )
        rows[fork_base].append(took)
        await asyncio.gather(*(session.delete() for session in fresh))
        print(f"  {runtime} {size_mb} MB: repeat {repeat + 1}/{repeats} done", flush=True)
    result: dict[str, Any] = {
        name: {"p50_s": statistics.median(values), "min_s": min(values), "n": len(values)}
        for name, values in rows.items()
    }
    for name, values in server.items():
        result[name]["gateway_p50_s"] = statistics.median(values)
    for name in ("pause", "resume"):
        result[name]["ratio_to_baseline"] = result[name]["p50_s"] / result[BASELINE]["p50_s"]
    result[fork]["ratio_to_baseline"] = result[fork]["p50_s"] / result[fork_base]["p50_s"]
    result["restored_by"] = sorted(str(value) for value in seen["restored_by"])
    result["verdicts"] = sorted(seen["verdicts"])
    result["snapshot_bytes"] = statistics.median(seen["snapshot_bytes"])
    return result


def report(runtime: str, size_mb: int, forks: int, result: dict[str, Any]) -> None:
    fork, fork_base = f"fork of {forks}", f"{forks} x {BASELINE}"
    baseline_of = {"pause": BASELINE, "resume": BASELINE, fork: fork_base}
    print(
        f"{runtime}, {size_mb} MB (restored_by {result['restored_by']}, verdicts {result['verdicts']}, "
        f"snapshot {result['snapshot_bytes'] / 2**20:.0f} MiB):"
    )
    for name in (BASELINE, "pause", "resume", fork, fork_base):
        row = result[name]
        gateway = f"  (gateway: {row['gateway_p50_s']:5.2f} s)" if "gateway_p50_s" in row else " " * 20
        ratio = f"  {row['ratio_to_baseline']:5.2f}x {baseline_of[name]}" if name in baseline_of else ""
        print(f"  {name:28} p50 {row['p50_s']:6.2f} s  min {row['min_s']:6.2f} s{gateway}{ratio}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="rounds per runtime and size")
    parser.add_argument("--sizes", default="50,200", help="state sizes in MB, comma-separated")
    parser.add_argument("--large", action="store_true", help=f"also {LARGE_MB} MB (~{3 * LARGE_MB} MB per session)")
    parser.add_argument("--forks", type=int, default=3, help="sessions per fork (1..10)")
    parser.add_argument("--runtime", action="append", choices=["runc", "runsc"], help="repeatable; default runc")
    parser.add_argument(
        "--memory-snapshots", choices=["off", "on"], default="off", help="the gateway's --memory-snapshots (gVisor)"
    )
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",") if size] + ([LARGE_MB] if args.large else [])
    runtimes = args.runtime or ["runc"]
    sessions = str(2 * args.forks + 2)
    flags = ["--default-runtime", "runc", "--max-sessions", sessions, "--max-sessions-total", sessions]
    flags += ["--memory-snapshots", args.memory_snapshots]
    async with served_gateway(flags, request_timeout=600) as client:
        for runtime in runtimes:
            results: dict[str, Any] = {}
            for size_mb in sizes:
                result = await measure(client, runtime, size_mb, args.forks, args.repeats)
                report(runtime, size_mb, args.forks, result)
                results[f"{size_mb} MB"] = result
            memory = args.memory_snapshots == "on" and runtime == "runsc"
            save_for_runtime("snapshots.json", f"{runtime}+memory" if memory else runtime, results)


if __name__ == "__main__":
    asyncio.run(main())
