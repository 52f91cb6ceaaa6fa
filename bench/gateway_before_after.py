"""What a change cost a gateway user: execute round trips of this tree's gateway against an earlier one's.

Both gateways run at once, each from its own checkout, virtualenv and image, started through
their own ``sandkernel serve`` (no warm pool); rounds alternate between them (so machine drift
hits both alike) and each round times trivial ``1+1`` round trips through the session API
(HTTP, keep-alive) and through the Jupyter kernel websocket (what JupyterLab uses). Prepare the
earlier tree as for before_after.py::

    git worktree add /tmp/sk-before <commit> && python -m venv /tmp/sk-before/.venv
    /tmp/sk-before/.venv/bin/pip install -e /tmp/sk-before
    python bench/gateway_before_after.py --before /tmp/sk-before --before-image sandkernel-kernel:before

Prints medians and after/before ratios per runtime and door; writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from execute_roundtrip import TOKEN, api, free_port, session_api_round_trips, wait_http, websocket_round_trips
from results_dir import results_path

HERE = Path(__file__).resolve().parents[1]
DOORS = ("session API", "websocket")


def start_gateway(tree: Path, image: str, runtime: str, notebooks: str, state: str) -> tuple[subprocess.Popen, int]:
    """``sandkernel serve`` of ``tree``, with its own image and state dir ``state``, on a free
    loopback port."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDKERNEL_")}
    env["SANDKERNEL_IMAGE"] = image
    # A tree that keeps sessions across restarts keeps them in a private catalog and removes them
    # on exit (older trees ignore these two variables).
    env["SANDKERNEL_ON_EXIT"] = "delete"
    env["SANDKERNEL_STATE_DIR"] = state
    command = [
        str(tree / ".venv" / "bin" / "sandkernel"),
        "serve",
        "--ip",
        "127.0.0.1",
        "--port",
        str(port),
        "--token",
        TOKEN,
        "--pool-size",
        "0",
        "--default-runtime",
        runtime,
        "--notebook-dir",
        notebooks,
    ]
    proc = subprocess.Popen(command, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


async def measure(runtime: str, contenders: dict[str, tuple[Path, str]], rounds: int, n: int) -> dict:
    samples = {name: {door: [] for door in DOORS} for name in contenders}
    procs = []
    # Removed once the gateways exited (they removed their sandboxes): nothing left in /tmp.
    with tempfile.TemporaryDirectory() as notebooks, tempfile.TemporaryDirectory() as states:
        try:
            sessions = {}
            for name, (tree, image) in contenders.items():
                state = tempfile.mkdtemp(prefix="state-", dir=states)
                proc, port = start_gateway(tree, image, runtime, notebooks, state)
                procs.append(proc)
                base = f"http://127.0.0.1:{port}"
                await wait_http(base + "/api/health", proc)
                session = await api(base, "POST", "/api/sessions", TOKEN, {})
                sessions[name] = (port, session)
            for round_no in range(rounds):
                for name, (port, session) in sessions.items():
                    trips = await asyncio.to_thread(session_api_round_trips, port, session["id"], n)
                    samples[name]["session API"].extend(trips)
                    ws_url = f"ws://127.0.0.1:{port}/api/kernels/{session['kernel']['id']}/channels"
                    samples[name]["websocket"].extend(await websocket_round_trips(ws_url, TOKEN, n))
                print(f"  {runtime}: round {round_no + 1}/{rounds}", file=sys.stderr, flush=True)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=120)
    report = {}
    for door in DOORS:
        before = statistics.median(samples["before"][door]) * 1000
        after = statistics.median(samples["after"][door]) * 1000
        report[door] = {"before_ms": before, "after_ms": after, "ratio": after / before}
        print(f"{runtime:7} {door:12} {before:14.2f} {after:13.2f} {after / before:12.2f}x")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="checkout of the earlier tree (with .venv)")
    parser.add_argument("--before-image", required=True, help="the earlier tree's kernel image tag")
    parser.add_argument("--after-image", default=None, help="this tree's image (default: its default tag)")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per runtime")
    parser.add_argument("--n", type=int, default=100, help="round trips per door, tree and round")
    parser.add_argument("--runtimes", default="runc,runsc", help="comma-separated runtimes")
    args = parser.parse_args()
    from sandkernel.kernels.model.profiles import DEFAULT_IMAGE

    contenders = {
        "before": (args.before.resolve(), args.before_image),
        "after": (HERE, args.after_image or DEFAULT_IMAGE),
    }
    print(f"{'runtime':7} {'door':12} {'before p50 ms':>14} {'after p50 ms':>13} {'after/before':>13}")
    runtimes = args.runtimes.split(",")
    report = {runtime: asyncio.run(measure(runtime, contenders, args.rounds, args.n)) for runtime in runtimes}
    out = results_path("gateway_before_after.json")
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
