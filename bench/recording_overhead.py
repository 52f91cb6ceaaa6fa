"""Recording overhead: trivial execute round trip with and without the transcript recorder,
on two sessions of the same kind, interleaved in one run so machine noise hits both alike.

Usage: python bench/recording_overhead.py [--n 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from results_dir import results_path

from sandkernel.kernels.execution.session import KernelSession
from sandkernel.notebooks.observer import attach_transcript
from sandkernel.notebooks.recorder import TranscriptRecorder


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="executes per contender")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        recorder = TranscriptRecorder(Path(tmp) / "bench.ipynb", {})
        plain = await KernelSession.start()
        recorded = await KernelSession.start()
        await attach_transcript(recorded, recorder)
        samples: dict[str, list[float]] = {"without recording": [], "with recording": []}
        try:
            for i in range(args.n + 20):
                for name, session in (("without recording", plain), ("with recording", recorded)):
                    t0 = time.perf_counter()
                    await session.execute("1+1", timeout=60)
                    if i >= 20:
                        samples[name].append(time.perf_counter() - t0)
        finally:
            await plain.shutdown()
            await recorded.shutdown()
    p50 = {name: statistics.median(values) * 1000 for name, values in samples.items()}
    overhead = p50["with recording"] / p50["without recording"] - 1
    for name, value in p50.items():
        print(f"{name:18} p50 {value:6.2f} ms")
    print(f"recording overhead: {overhead * 100:+.1f}% of a trivial execute (target < 5%)")
    out = results_path("recording_overhead.json")
    out.write_text(json.dumps({"n": args.n, "p50_ms": p50, "overhead": overhead}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
