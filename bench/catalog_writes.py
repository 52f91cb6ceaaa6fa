"""What the session catalog adds to a session's life: one ``put`` (session create, before the
session is handed out) and one ``update`` (an execution starts or ends), awaited from the event
loop as the gateway does, against baselines measured in the same run, interleaved round by round:

- the bare thread hop every catalog call pays (``run_in_executor`` of a no-op on a one-thread pool);
- writing the same record as a JSON file with ``sandkernel.atomic.write_atomic`` (with its fsyncs,
  and without), what a file-per-session catalog would cost;
- the same ``put`` with ``synchronous=FULL`` (an fsync per commit), to show what the chosen
  ``NORMAL`` saves (both survive ``kill -9``; FULL also survives a power loss).

Target: put ≤ 5 ms (issue 13). Usage: python bench/catalog_writes.py [--n 500]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import secrets
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from results_dir import results_path

from sandkernel.atomic import write_atomic
from sandkernel.kernels.durable import SandboxRecord, open_store


def sample_record(i: int) -> SandboxRecord:
    """A record shaped like a real session's (connection info with a key, profile, gateway entry)."""
    kernel = {
        "kernel_id": secrets.token_hex(16),
        "container_id": secrets.token_hex(32),
        "uid": 200000 + i,
        "runtime_dir": f"/run/sandkernel/{secrets.token_hex(6)}",
        "image_id": "sha256:" + secrets.token_hex(32),
        "connection": {"key": secrets.token_hex(32), "transport": "ipc", "signature_scheme": "hmac-sha256"},
        "profile": {"memory_mb": 1024, "cpus": 1.0, "pids": 256, "runtime": "runsc", "execute_timeout": 300.0},
    }
    gateway = {
        "created": time.time(),
        "metadata": {"agent": "bench"},
        "kernel_name": "python3",
        "transcript": f"/var/lib/sandkernel/notebooks/{i}.ipynb",
        "last_activity": time.time(),
    }
    return SandboxRecord(f"bench-{i:06d}", "session", kernel, tenant="alice", gateway=gateway)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50_ms": statistics.median(ordered) * 1000, "p95_ms": ordered[int(len(ordered) * 0.95) - 1] * 1000}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=500, help="writes per contender")
    args = parser.parse_args()
    loop = asyncio.get_running_loop()
    hop_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(Path(tmp) / "catalog.sqlite3")
        full = open_store(Path(tmp) / "full.sqlite3")
        await loop.run_in_executor(full._executor, lambda: full._conn.execute("PRAGMA synchronous=FULL"))
        files = Path(tmp) / "files"
        running = {"code": "df.describe()", "timeout": 300.0, "started_at": time.time()}

        def json_file(record: SandboxRecord, durable: bool) -> Callable[[], Awaitable[None]]:
            data = json.dumps(record.__dict__, default=str)
            path = files / f"{record.session_id}.json"
            return lambda: loop.run_in_executor(hop_pool, lambda: write_atomic(path, data, durable=durable))

        contenders: dict[str, Callable[[int], Callable[[], Awaitable[None]]]] = {
            "thread hop (no-op)": lambda i: lambda: loop.run_in_executor(hop_pool, lambda: None),
            "put (catalog, NORMAL)": lambda i: lambda: store.put(sample_record(i)),
            "update (running set)": lambda i: lambda: store.update(f"bench-{i:06d}", running=running),
            "put (synchronous=FULL)": lambda i: lambda: full.put(sample_record(i)),
            "JSON file, write_atomic durable": lambda i: json_file(sample_record(i), True),
            "JSON file, write_atomic no fsync": lambda i: json_file(sample_record(i), False),
        }
        samples: dict[str, list[float]] = {name: [] for name in contenders}
        warmup = min(20, args.n)
        try:
            for i in range(args.n + warmup):
                for name, make in contenders.items():
                    call = make(i)
                    t0 = time.perf_counter()
                    await call()
                    if i >= warmup:
                        samples[name].append(time.perf_counter() - t0)
        finally:
            await store.close()
            await full.close()
            hop_pool.shutdown()
    results = {name: summary(values) for name, values in samples.items()}
    for name, r in results.items():
        print(f"{name:34} p50 {r['p50_ms']:7.3f} ms   p95 {r['p95_ms']:7.3f} ms")
    put = results["put (catalog, NORMAL)"]
    verdict = "meets" if put["p95_ms"] <= 5 else "MISSES"
    print(f"catalog put: p50 {put['p50_ms']:.3f} ms, p95 {put['p95_ms']:.3f} ms per session create ({verdict} ≤ 5 ms)")
    out = results_path("catalog_writes.json")
    out.write_text(json.dumps({"n": args.n, "results": results}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
