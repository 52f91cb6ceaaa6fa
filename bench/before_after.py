"""What a change cost: cold start and execute round trip of this tree against an earlier one, in one run.

Each round starts one session with each tree's own code and image, alternating (so machine drift
hits both alike), and times ``KernelSession.start()`` → ``execute("1+1")`` and then trivial
execute round trips on that session. The earlier tree needs its own checkout, virtualenv and
image, for example::

    git worktree add /tmp/sk-before <commit> && python -m venv /tmp/sk-before/.venv
    /tmp/sk-before/.venv/bin/pip install -e /tmp/sk-before
    SANDKERNEL_IMAGE_DIR=/tmp/sk-before/kernel-image sandkernel image build --tag sandkernel-kernel:before
    python bench/before_after.py --before /tmp/sk-before --before-image sandkernel-kernel:before

Prints medians and after/before ratios per runtime; writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from results_dir import results_path

HERE = Path(__file__).resolve().parents[1]

# Runs inside one tree's interpreter: one cold start, then ``executes`` round trips; prints JSON.
PROBE = r"""
import asyncio, json, sys, time
from sandkernel.kernels.execution.session import KernelSession

async def main(runtime, executes):
    t0 = time.perf_counter()
    session = await KernelSession.start(overrides={"runtime": runtime})
    try:
        result = await session.execute("1+1", timeout=60)
        cold = time.perf_counter() - t0
        assert result.outputs[-1]["data"]["text/plain"] == "2", result
        trips = []
        for _ in range(executes):
            t1 = time.perf_counter()
            await session.execute("1+1", timeout=60)
            trips.append(time.perf_counter() - t1)
    finally:
        await session.shutdown()
    print(json.dumps({"cold": cold, "trips": trips}))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def probe(tree: Path, image: str, runtime: str, executes: int) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDKERNEL_")}
    env["SANDKERNEL_IMAGE"] = image
    python = tree / ".venv" / "bin" / "python"
    done = subprocess.run(
        [str(python), "-c", PROBE, runtime, str(executes)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"probe of {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="checkout of the earlier tree (with .venv)")
    parser.add_argument("--before-image", required=True, help="the earlier tree's kernel image tag")
    parser.add_argument("--after-image", default=None, help="this tree's image (default: its default tag)")
    parser.add_argument("--rounds", type=int, default=8, help="cold starts per tree and runtime")
    parser.add_argument("--executes", type=int, default=100, help="round trips per cold start")
    parser.add_argument("--runtimes", default="runc,runsc", help="comma-separated runtimes")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from sandkernel.kernels.model.profiles import DEFAULT_IMAGE

    contenders = {
        "before": (args.before.resolve(), args.before_image),
        "after": (HERE, args.after_image or DEFAULT_IMAGE),
    }
    report: dict[str, dict] = {}
    print(f"{'runtime':7} {'metric':20} {'before p50 ms':>14} {'after p50 ms':>13} {'after/before':>13}")
    for runtime in args.runtimes.split(","):
        samples = {name: {"cold": [], "trips": []} for name in contenders}
        for round_no in range(args.rounds):
            for name, (tree, image) in contenders.items():
                got = probe(tree, image, runtime, args.executes)
                samples[name]["cold"].append(got["cold"])
                samples[name]["trips"].extend(got["trips"])
            print(f"  {runtime}: round {round_no + 1}/{args.rounds}", file=sys.stderr, flush=True)
        report[runtime] = {}
        for metric, label in (("cold", "cold start → 1+1"), ("trips", "execute round trip")):
            before = statistics.median(samples["before"][metric]) * 1000
            after = statistics.median(samples["after"][metric]) * 1000
            report[runtime][metric] = {"before_ms": before, "after_ms": after, "ratio": after / before}
            print(f"{runtime:7} {label:20} {before:14.1f} {after:13.1f} {after / before:12.2f}x")
    out = results_path("before_after.json")
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
