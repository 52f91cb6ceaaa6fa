"""Cold start to first result, and execute round trip, against a bare docker-run baseline.

For each runtime (runc, and runsc where registered) it measures, in the same run:
- sandkernel: ``KernelSession.start()`` → first ``execute("1+1")`` result (full hardening,
  ipc transport, seccomp), then N trivial execute round trips on that session;
- baseline: a bare ``docker run`` of the same image with ipykernel on ipc sockets in a
  bind-mounted dir (no hardening, no lock, no seccomp), reached with raw jupyter_client.
Prints medians, p95 and sandkernel/baseline ratios; writes JSON to bench/results/.
Usage: python bench/cold_start.py [--starts 10] [--executes 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from jupyter_client import AsyncKernelClient
from results_dir import results_path

from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.model.profiles import resolve_profile
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, owner_label


def _quiet(msg: dict) -> None:
    """Swallow outputs (execute_interactive prints them by default)."""


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"median_ms": statistics.median(ordered) * 1000, "p95_ms": p95 * 1000, "n": len(ordered)}


async def sandkernel_run(runtime: str, starts: int, executes: int) -> tuple[list[float], list[float]]:
    cold, round_trips = [], []
    for i in range(starts):
        t0 = time.perf_counter()
        session = await KernelSession.start(overrides={"runtime": runtime})
        try:
            result = await session.execute("1+1", timeout=60)
            cold.append(time.perf_counter() - t0)
            assert result.outputs[-1]["data"]["text/plain"] == "2"
            if i == 0:
                for _ in range(executes):
                    t1 = time.perf_counter()
                    await session.execute("1+1", timeout=60)
                    round_trips.append(time.perf_counter() - t1)
        finally:
            await session.shutdown()
    return cold, round_trips


def start_bare_kernel(runtime: str, label: str) -> tuple[object, Path, dict]:
    """A bare ``docker run`` of the kernel image with ipykernel on ipc sockets in a bind-mounted
    dir: no hardening, no lock, no seccomp (what a hand-rolled setup does). Blocking."""
    engine = default_engine()
    rundir = Path(tempfile.mkdtemp(prefix="skb-", dir="/tmp"))
    os.chmod(rundir, 0o777)
    info = {
        "transport": "ipc",
        "ip": "/r/k",
        "key": uuid.uuid4().hex,
        "signature_scheme": "hmac-sha256",
        "shell_port": 1,
        "iopub_port": 2,
        "stdin_port": 3,
        "control_port": 4,
        "hb_port": 5,
    }
    (rundir / "c.json").write_text(json.dumps(info))
    container = engine.client.containers.run(
        resolve_profile().image,
        ["python", "-m", "ipykernel_launcher", "-f", "/r/c.json"],
        entrypoint=[],
        runtime=runtime,
        network_mode="none",
        detach=True,
        user="10001:10001",
        volumes={str(rundir): {"bind": "/r", "mode": "rw"}},
        labels={"sandkernel.session": label, OWNER_LABEL: owner_label()},  # owned: no gateway reaps it
        environment={"HOME": "/tmp"},
        # runsc's --oci-seccomp mis-evaluates clone() argument rules (Docker's default profile
        # and ours alike) and refuses thread creation, so the bare baseline runs unconfined
        # there; sandkernel's kernels install their filter themselves (start_kernel.py).
        security_opt=["seccomp=unconfined"] if runtime == "runsc" else [],
    )
    return container, rundir, info


def bare_sockets_ready(rundir: Path) -> bool:
    return all((rundir / f"k-{p}").exists() for p in range(1, 6))


def remove_bare_kernel(container: object, rundir: Path) -> None:
    container.remove(force=True)  # type: ignore[attr-defined]
    for entry in rundir.iterdir():
        entry.unlink()
    rundir.rmdir()


async def baseline_run(runtime: str, starts: int, executes: int) -> tuple[list[float], list[float]]:
    """Bare docker run + ipykernel over ipc, raw jupyter_client: what a hand-rolled setup does."""
    engine = default_engine()
    cold, round_trips = [], []
    for i in range(starts):
        t0 = time.perf_counter()
        container, rundir, info = await engine.run(start_bare_kernel, runtime, "bench-baseline")
        try:
            client = AsyncKernelClient()
            client.load_connection_info(dict(info, ip=str(rundir / "k")))
            deadline = time.monotonic() + 60
            while not bare_sockets_ready(rundir):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"baseline kernel did not start: {container.logs()[-500:]!r}")
                await asyncio.sleep(0.005)
            client.start_channels()
            await client.wait_for_ready(timeout=60)
            reply = await client.execute_interactive("1+1", timeout=60, output_hook=_quiet)
            cold.append(time.perf_counter() - t0)
            assert reply["content"]["status"] == "ok"
            if i == 0:
                for _ in range(executes):
                    t1 = time.perf_counter()
                    await client.execute_interactive("1+1", timeout=60, output_hook=_quiet)
                    round_trips.append(time.perf_counter() - t1)
            client.stop_channels()
        finally:
            await engine.run(remove_bare_kernel, container, rundir)
    return cold, round_trips


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=10, help="cold starts per runtime and contender")
    parser.add_argument("--executes", type=int, default=200, help="trivial round trips per contender")
    args = parser.parse_args()
    runtimes = ["runc"] + (["runsc"] if "runsc" in default_engine().runtimes_sync() else [])
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "runtimes": {}}
    print(f"{'runtime':7} {'metric':22} {'sandkernel p50/p95 ms':>24} {'baseline p50/p95 ms':>22} {'ratio p50':>9}")
    for runtime in runtimes:
        base_cold, base_rt = await baseline_run(runtime, args.starts, args.executes)
        sk_cold, sk_rt = await sandkernel_run(runtime, args.starts, args.executes)
        rows = {
            "cold start → 1+1": (summary(sk_cold), summary(base_cold)),
            "execute round trip": (summary(sk_rt), summary(base_rt)),
        }
        report["runtimes"][runtime] = {k: {"sandkernel": a, "baseline": b} for k, (a, b) in rows.items()}
        for metric, (a, b) in rows.items():
            ratio = a["median_ms"] / b["median_ms"]
            print(
                f"{runtime:7} {metric:22} {a['median_ms']:11.1f} /{a['p95_ms']:8.1f}   "
                f"{b['median_ms']:9.1f} /{b['p95_ms']:8.1f}   {ratio:8.2f}x"
            )
    out = results_path("cold_start.json")
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    asyncio.run(main())
