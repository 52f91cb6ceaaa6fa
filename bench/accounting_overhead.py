"""Per-cell accounting overhead: a trivial execute with accounting on and off, on ONE session,
alternating call by call so machine noise and the container's placement hit both alike.

"On" is what every execute pays when accounting is enabled: CellMeter.start (cgroup counters,
peak-memory reset, a workspace snapshot) before the cell and CellMeter.finish (counters, a
second snapshot, the diff) after it. With the session's own meter (``session.meter``, issue 15's
plumbing) the bench toggles it; before that plumbing it drives a CellMeter around execute itself.
The workspace holds ``--files`` small files, so the walk is not of an empty directory.

Usage: python bench/accounting_overhead.py [--n 300] [--runtime runc] [--files 50]
Goal: on/off p50 ratio <= 1.05 under runc.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from execute_roundtrip import stats
from results_dir import results_path

from sandkernel.kernels.execution.accounting import CellMeter
from sandkernel.kernels.execution.session import KernelSession

WARMUP = 20


async def measure(runtime: str, n: int, files: int) -> dict:
    session = await KernelSession.start(overrides={"runtime": runtime})
    try:
        builtin = getattr(session, "meter", None)
        meter = builtin if isinstance(builtin, CellMeter) else CellMeter(session)
        await session.execute(
            f"import os\nos.makedirs('data', exist_ok=True)\n"
            f"for i in range({files}): open(f'data/f{{i}}.txt', 'w').write(str(i))",
            timeout=60,
        )
        samples: dict[str, list[float]] = {"off": [], "on": []}
        checked = None

        async def once(on: bool) -> float:
            nonlocal checked
            if builtin is not None:  # the session measures itself: on = its meter, off = none
                session.meter = meter if on else None
                t0 = time.perf_counter()
                result = await session.execute("1+1", timeout=60)
                elapsed = time.perf_counter() - t0
                if on:
                    checked = getattr(result, "accounting", None)
                return elapsed
            t0 = time.perf_counter()
            if on:
                await meter.start()
                await session.execute("1+1", timeout=60)
                checked = await meter.finish(time.perf_counter() - t0)
            else:
                await session.execute("1+1", timeout=60)
            return time.perf_counter() - t0

        for i in range(n + WARMUP):
            order = (False, True) if i % 2 else (True, False)  # neither always goes first
            for on in order:
                elapsed = await once(on)
                if i >= WARMUP:
                    samples["on" if on else "off"].append(elapsed)
        if builtin is not None:
            session.meter = builtin
    finally:
        await session.shutdown()
    result = {name: stats(values) for name, values in samples.items()}
    result["ratio_p50"] = result["on"]["p50_ms"] / result["off"]["p50_ms"]
    result["sample"] = checked  # one accounting dict, to show that "on" measured something
    result["driven_by"] = "session.meter" if builtin is not None else "CellMeter around execute"
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="executes per contender")
    parser.add_argument("--runtime", action="append", choices=["runc", "runsc"], help="repeatable; default runc")
    parser.add_argument("--files", type=int, default=50, help="small files in the workspace, walked each cell")
    args = parser.parse_args()
    results = {}
    for runtime in args.runtime or ["runc"]:
        result = await measure(runtime, args.n, args.files)
        results[runtime] = result
        on, off = result["on"], result["off"]
        print(f"{runtime}: accounting off p50 {off['p50_ms']:6.2f} ms  p95 {off['p95_ms']:6.2f} ms")
        print(f"{runtime}: accounting on  p50 {on['p50_ms']:6.2f} ms  p95 {on['p95_ms']:6.2f} ms")
        print(f"{runtime}: on/off ratio (p50) {result['ratio_p50']:.3f} (goal <= 1.05; {result['driven_by']})")
        assert result["sample"] and result["sample"]["cpu_seconds"] is not None, result["sample"]
    out = results_path("accounting_overhead.json")
    out.write_text(json.dumps({"n": args.n, "files": args.files, **results}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
