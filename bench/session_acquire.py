"""Session acquire → first result of ``1+1``, through the gateway's session API, three ways in
one run: from the warm pool, from a cold start, and a bare ``docker run`` + ipykernel baseline
(no gateway, no hardening; bench/cold_start.py's). Each warm sample waits for the pool to refill
first, as a gateway whose demand stays below its refill rate would see.

Prints medians, p95 and ratios; writes bench/results/session_acquire.json.
Usage: python bench/session_acquire.py [--n 10] [--runtime runc]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time

from cold_start import baseline_run, summary
from inprocess_gateway import GatewayApi, inprocess_gateway
from results_dir import results_path

RESULTS = results_path("session_acquire.json")


async def gateway_samples(n: int, pool_size: int) -> list[float]:
    samples = []
    async with inprocess_gateway(pool_size=pool_size, max_sessions=n + 2, max_sessions_total=n + 4) as port:
        call = GatewayApi(port)
        for _ in range(n):
            if pool_size:
                while (await call("GET", "/api/health"))["warm_pool"] < pool_size:
                    await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            # The default profile (its runtime from SANDKERNEL_RUNTIME): what the pool serves.
            session = await call("POST", "/api/sessions", {})
            result = await call("POST", f"/api/sessions/{session['id']}/execute", {"code": "1+1"})
            samples.append(time.perf_counter() - t0)
            assert result["outputs"][0]["data"]["text/plain"] == "2"
            await call("DELETE", f"/api/sessions/{session['id']}")
    return samples


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10, help="acquisitions per contender")
    parser.add_argument("--runtime", default="runc", choices=["runc", "runsc"])
    args = parser.parse_args()
    os.environ["SANDKERNEL_RUNTIME"] = args.runtime  # the default profile's runtime, pooled or not
    warm = await gateway_samples(args.n, 1)
    cold = await gateway_samples(args.n, 0)
    bare, _ = await baseline_run(args.runtime, args.n, 0)
    rows = {"warm pool": summary(warm), "cold start": summary(cold), "bare docker run + ipykernel": summary(bare)}
    print(f"session acquire -> first result of 1+1, {args.runtime}, n={args.n}")
    for name, row in rows.items():
        print(f"  {name:30} p50 {row['median_ms']:8.1f} ms   p95 {row['p95_ms']:8.1f} ms")
    warm_ms = rows["warm pool"]["median_ms"]
    print(
        f"  warm is {rows['cold start']['median_ms'] / warm_ms:.1f}x faster than a cold start and "
        f"{rows['bare docker run + ipykernel']['median_ms'] / warm_ms:.1f}x faster than bare docker"
    )
    RESULTS.parent.mkdir(exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[args.runtime] = {"n": args.n, "machine": f"{platform.machine()}, {os.cpu_count()} cores", **rows}
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
