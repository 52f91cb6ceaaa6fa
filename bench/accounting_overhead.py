"""Per-cell accounting overhead: a trivial execute with accounting on and off, on ONE session,
alternating call by call (the order rotating each round) so machine noise and the container's
placement hit every contender alike.

Contenders, each the session's own meter (``session.meter``) swapped in for its call:
- ``off``: no meter (``accounting=False``);
- ``on``: the default meter: cgroup counters and a fanotify watch on the workspace's filesystem
  that says whether anything changed, so a cell that writes nothing takes no walk;
- ``on, walk every cell``: a meter without the watch (``CellMeter(watch=False)``: what a host
  without fanotify pays, and what every host paid before the watch), for the before/after.

Run with the workspace empty, then again holding ``--files`` small files (walked by a walk).
The JSON also says how many walks the ``on`` meter took over its trivial cells (0 when the
watch works) and the load average before and after (other work on the machine skews both sides).

Usage: python bench/accounting_overhead.py [--n 300] [--runtime runc] [--files 50]
Goal: on/off p50 ratio <= 1.05 under runc, with 0 files and with 50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from execute_roundtrip import stats
from results_dir import results_path

from sandkernel.kernels.execution.accounting import CellMeter
from sandkernel.kernels.execution.session import KernelSession

WARMUP = 20
WATCHED, WALKED = "on", "on, walk every cell"


async def contenders(session: KernelSession, n: int) -> dict:
    """Alternate the three contenders over ``n`` measured rounds (after WARMUP)."""
    meters: dict[str, CellMeter | None] = {"off": None, WATCHED: session.meter, WALKED: CellMeter(session, watch=False)}
    samples: dict[str, list[float]] = {name: [] for name in meters}
    names = list(meters)
    sample, walks = None, 0
    for i in range(n + WARMUP):
        if i == WARMUP:
            walks = meters[WATCHED].walks  # type: ignore[union-attr]
        for name in names[i % 3 :] + names[: i % 3]:
            session.meter = meters[name]
            t0 = time.perf_counter()
            result = await session.execute("1+1", timeout=60)
            elapsed = time.perf_counter() - t0
            if i >= WARMUP:
                samples[name].append(elapsed)
            if name == WATCHED:
                sample = result.accounting
    watched = meters[WATCHED]
    session.meter = watched
    out = {name: stats(values) for name, values in samples.items()}
    for name in (WATCHED, WALKED):
        out[f"ratio_p50 {name}"] = out[name]["p50_ms"] / out["off"]["p50_ms"]
    out["walks_on"] = watched.walks - walks  # type: ignore[union-attr]
    out["watching"] = watched.watching  # type: ignore[union-attr]
    out["sample"] = sample  # one accounting dict, to show that "on" measured something
    return out


async def measure(runtime: str, n: int, files: int) -> dict:
    session = await KernelSession.start(overrides={"runtime": runtime})
    try:
        assert session.meter is not None, "the session carries no meter"
        result = {"empty workspace": await contenders(session, n)}
        await session.execute(
            f"import os\nos.makedirs('data', exist_ok=True)\n"
            f"for i in range({files}): open(f'data/f{{i}}.txt', 'w').write(str(i))",
            timeout=60,
        )
        result[f"{files} files"] = await contenders(session, n)
    finally:
        await session.shutdown()
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="executes per contender and workspace")
    parser.add_argument("--runtime", action="append", choices=["runc", "runsc"], help="repeatable; default runc")
    parser.add_argument("--files", type=int, default=50, help="small files in the workspace for the second run")
    args = parser.parse_args()
    results: dict = {"n": args.n, "files": args.files, "loadavg_before": os.getloadavg()}
    for runtime in args.runtime or ["runc"]:
        results[runtime] = await measure(runtime, args.n, args.files)
        for workspace, data in results[runtime].items():
            off = data["off"]
            print(f"{runtime}, {workspace}: off p50 {off['p50_ms']:6.2f} ms  p95 {off['p95_ms']:6.2f} ms")
            for name in (WATCHED, WALKED):
                row = data[name]
                print(
                    f"{runtime}, {workspace}: {name:20} p50 {row['p50_ms']:6.2f} ms  p95 {row['p95_ms']:6.2f} ms"
                    f"  ratio {data[f'ratio_p50 {name}']:.3f}"
                )
            print(f"{runtime}, {workspace}: walks by 'on' over {args.n} trivial cells: {data['walks_on']}")
            assert data["sample"] and data["sample"]["cpu_seconds"] is not None, data["sample"]
    results["loadavg_after"] = os.getloadavg()
    print(f"load average before {results['loadavg_before']}, after {results['loadavg_after']} (goal: on <= 1.05)")
    results_path("accounting_overhead.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
