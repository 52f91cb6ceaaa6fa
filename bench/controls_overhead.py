"""What the production controls add to a trivial execute, through the session API, measured in the
same run against a gateway with all of them off:

- off: no accounting, no audit stream, no execution policy (the baseline)
- defaults: per-cell accounting and the audit stream on (what ``sandkernel serve`` runs)
- defaults + policy: also the commented example policy (docs/exec-policy.example.toml)

One in-process gateway per configuration, one session each, called round by round in turn so
drift (load, caches) hits all alike. Prints p50/p95 and each one's ratio to the baseline; writes
bench/results/controls_overhead.json. The goal (issue 15): accounting costs a trivial execute at
most 5%.
Usage: python bench/controls_overhead.py [--n 300] [--runtime runc|runsc]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
from pathlib import Path

from execute_roundtrip import interleaved, stats
from results_dir import results_path

from sandkernel.local_gateway import local_gateway

BASELINE = "off (no accounting, audit or policy)"
EXAMPLE_POLICY = Path(__file__).resolve().parents[1] / "docs" / "exec-policy.example.toml"
CONFIGURATIONS = {
    BASELINE: {"accounting": False, "audit": False},
    "defaults (accounting + audit)": {"accounting": True, "audit": True},
    "defaults + example policy": {"accounting": True, "audit": True, "exec_policy_file": EXAMPLE_POLICY},
}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="executes per configuration (after 10 warm-up rounds)")
    parser.add_argument("--runtime", default="runc", choices=["runc", "runsc"])
    args = parser.parse_args()
    async with contextlib.AsyncExitStack() as stack:
        sessions = {}
        for name, options in CONFIGURATIONS.items():
            client = await stack.enter_async_context(local_gateway(default_runtime=args.runtime, **options))
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
    path = results_path("controls_overhead.json")
    previous = json.loads(path.read_text()) if path.exists() else {}
    previous[args.runtime] = results
    path.write_text(json.dumps(previous, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
