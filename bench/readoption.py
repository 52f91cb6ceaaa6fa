"""Re-adoption: how long a restarted gateway takes to serve every session it adopted.

One run: a ``sandkernel serve`` process (runc, no pool) gets ``--n`` live sessions (each holds a
variable), is killed with SIGKILL, and a new process on the same state dir is started. Measured
from the new process's ``Popen`` to (a) its first answered request (it listens only once the
catalog is adopted) and (b) every session having answered an execute that reads its variable.
Baseline in the same run: the same command starting with an empty catalog (its own state dir),
to its first answered request: what a gateway costs to start at all (Python imports, the engine,
the profiles). The gateway's own adoption time (its start-up summary line) is printed too.

Target (issue 13): ≤ 2 s for 50 sessions on this machine. Everything is removed at the end (the
last gateway runs with ``--on-exit delete``).

Rounds alternate an empty start and a kill -9 + restart; medians are printed with the ratio.
Writes bench/results/readoption.json.
Usage: python bench/readoption.py [--n 50] [--runtime runc] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from results_dir import results_path
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from sandkernel.gateway.auth import new_token

RESULTS = results_path("readoption.json")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Serve:
    def __init__(self, state: Path, notebooks: Path, runtime: str, token: str, n: int) -> None:
        self.state, self.notebooks, self.runtime, self.token, self.n = state, notebooks, runtime, token, n
        self.port = free_port()
        self.lines: list[str] = []
        self.proc: subprocess.Popen[str] | None = None
        self.http = AsyncHTTPClient(force_instance=True, max_clients=self.n + 10)

    def launch(self, *extra: str) -> float:
        self.port = free_port()
        self.lines = []
        argv = [
            sys.executable, "-m", "sandkernel.cli", "serve", "--port", str(self.port), f"--token={self.token}",
            "--state-dir", str(self.state), "--notebook-dir", str(self.notebooks), "--pool-size", "0",
            "--default-runtime", self.runtime, "--max-sessions", str(self.n + 5),
            "--max-sessions-total", str(self.n + 10), *extra,
        ]  # fmt: skip
        started = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        proc = self.proc

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.lines.append(line)

        threading.Thread(target=read, daemon=True).start()
        return started

    async def call(self, method: str, path: str, body: dict | None = None, timeout: float = 300) -> dict | list:
        request = HTTPRequest(
            f"http://127.0.0.1:{self.port}{path}",
            method=method,
            body=json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None),
            headers={"Authorization": f"token {self.token}"},
            request_timeout=timeout,
        )
        response = await self.http.fetch(request)
        return json.loads(response.body) if response.body else {}

    async def first_answer(self, deadline: float = 300.0) -> float:
        """Poll /api/health every 10 ms until it answers; the time it did (perf_counter)."""
        end = time.perf_counter() + deadline
        while time.perf_counter() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise SystemExit("the gateway exited:\n" + "".join(self.lines))
            try:
                await self.call("GET", "/api/health", timeout=2)
                return time.perf_counter()
            except (ConnectionError, HTTPClientError, OSError):
                await asyncio.sleep(0.01)
        raise SystemExit("the gateway did not answer:\n" + "".join(self.lines))

    def stop(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(300)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50, help="live sessions to adopt")
    parser.add_argument("--runtime", default="runc", choices=["runc", "runsc"])
    parser.add_argument("--rounds", type=int, default=3, help="kill -9 + restart rounds (and empty starts)")
    args = parser.parse_args()
    token = new_token()
    baselines: list[float] = []
    listening: list[float] = []
    serving: list[float] = []
    adoption: list[float] = []
    with tempfile.TemporaryDirectory(prefix="sandkernel-readoption-") as tmp:
        root = Path(tmp)
        empty = Serve(root / "empty-state", root / "nb", args.runtime, token, args.n)
        serve = Serve(root / "state", root / "nb", args.runtime, token, args.n)
        serve.launch()
        await serve.first_answer()
        ids: list[str] = []
        try:
            created_at = time.perf_counter()
            for _ in range(0, args.n, 10):  # ten at a time: the host starts sandboxes, not the bench
                batch = await asyncio.gather(*(serve.call("POST", "/api/sessions", {}) for _ in range(10)))
                ids += [s["id"] for s in batch][: args.n - len(ids)]
            await asyncio.gather(*(serve.call("POST", f"/api/sessions/{sid}/execute", {"code": f"v = {i}"})
                                   for i, sid in enumerate(ids)))  # fmt: skip
            print(f"{len(ids)} {args.runtime} sessions started in {time.perf_counter() - created_at:.1f}s")
            for _ in range(args.rounds):  # alternated, so load on the host hits both alike
                t0 = empty.launch("--on-exit", "delete")
                baselines.append(await empty.first_answer() - t0)
                empty.stop()

                serve.stop(signal.SIGKILL)
                t0 = serve.launch()
                listening.append(await serve.first_answer() - t0)

                async def answers(i: int, sid: str) -> None:
                    result = await serve.call("POST", f"/api/sessions/{sid}/execute", {"code": "print(v)"})
                    assert result["status"] == "ok" and result["text"] == f"{i}\n", result  # type: ignore[index]

                await asyncio.gather(*(answers(i, sid) for i, sid in enumerate(ids)))
                serving.append(time.perf_counter() - t0)
                summary = next((line.strip() for line in serve.lines if "adopted" in line), "")
                match = re.search(r"adopted (\d+) session\(s\), (\d+) lost.* in ([\d.]+)s", summary)
                assert match and int(match.group(1)) == len(ids) and match.group(2) == "0", summary
                adoption.append(float(match.group(3)))
        finally:
            serve.stop(signal.SIGKILL)
            serve.launch("--on-exit", "delete")  # adopts everything, then removes it on SIGTERM
            await serve.first_answer()
            serve.stop()

    baseline, listen, serve_all, adopt = (statistics.median(v) for v in (baselines, listening, serving, adoption))
    row = {
        "sessions": len(ids),
        "runtime": args.runtime,
        "rounds": args.rounds,
        "baseline_start_empty_catalog_s": [round(v, 3) for v in baselines],
        "restart_to_listening_s": [round(v, 3) for v in listening],
        "restart_to_all_sessions_answered_s": [round(v, 3) for v in serving],
        "adoption_in_process_s": adoption,
        "median_ratio_all_answered_to_baseline": round(serve_all / baseline, 2),
        "target_s": 2.0,
        "machine": platform.platform(),
        "cpus": __import__("os").cpu_count(),
    }
    print(f"re-adoption of {len(ids)} live {args.runtime} sessions after kill -9 (median of {args.rounds}):")
    print(f"  baseline: start with an empty catalog -> first answer   {baseline:6.2f} s")
    print(f"  restart -> first answer (all adopted)                   {listen:6.2f} s")
    print(f"  restart -> every session answered an execute           {serve_all:6.2f} s")
    print(f"  adoption itself (the gateway's start-up summary)        {adopt:6.2f} s  (target: 2 s for 50)")
    print(f"  ratio restart-to-all-answered / empty start: {serve_all / baseline:.2f}x; "
          f"the {len(ids)} sessions add {serve_all - baseline:.2f} s")  # fmt: skip
    RESULTS.write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
