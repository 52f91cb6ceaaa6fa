"""What the production controls add to a trivial execute, through the session API, measured in the
same run against a gateway with all of them off:

- off: no accounting, no audit stream, no execution policy (the baseline)
- defaults: per-cell accounting and the audit stream on (what ``sandkernel serve`` runs)
- defaults + policy: also the commented example policy (docs/exec-policy.example.toml)

One ``sandkernel serve`` process per configuration (each with its own state dir, as operators
run them), one session each, called round by round in turn so drift (load, caches) hits all
alike. Prints p50/p95 and each one's ratio to the baseline; writes
bench/results/controls_overhead.json. The goal (issue 15): accounting costs a trivial execute at
most 5%.
Usage: python bench/controls_overhead.py [--n 300] [--runtime runc|runsc]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
from pathlib import Path

from execute_roundtrip import interleaved, stats
from results_dir import save_for_runtime
from served import served_gateway

BASELINE = "off (no accounting, audit or policy)"
EXAMPLE_POLICY = Path(__file__).resolve().parents[1] / "docs" / "exec-policy.example.toml"
CONFIGURATIONS = {
    BASELINE: ["--no-accounting", "--no-audit"],
    "defaults (accounting + audit)": [],
    "defaults + example policy": ["--exec-policy", str(EXAMPLE_POLICY)],
}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="executes per configuration (after 10 warm-up rounds)")
    parser.add_argument("--runtime", default="runc", choices=["runc", "runsc"])
    args = parser.parse_args()
    async with contextlib.AsyncExitStack() as stack:
        sessions = {}
        for name, flags in CONFIGURATIONS.items():
            client = await stack.enter_async_context(served_gateway(["--default-runtime", args.runtime, *flags]))
            sessions[name] = await client.create_session()
        calls = {name: functools.partial(session.run, "1+1", check=True) for name, session in sessions.items()}
        samples = await interleaved(calls, args.n, warmup=10)
        for session in sessions.values():
            await session.delete()
    results = {name: stats(values) for name, values in samples.items()}
    base = results[BASELINE]["p50_ms"]
    print(f"{'controls':34} {'p50 ms':>8} {'p95 ms':>8} {'x off':>7}   ({args.runtime}, n={args.n})")
    for name, row in results.items():
        row["ratio_to_off"] = row["p50_ms"] / base
        print(f"{name:34} {row['p50_ms']:8.2f} {row['p95_ms']:8.2f} {row['ratio_to_off']:7.3f}")
    save_for_runtime("controls_overhead.json", args.runtime, results)


if __name__ == "__main__":
    asyncio.run(main())
