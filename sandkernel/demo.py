"""The main job: one sandboxed session doing real data work, leaving its notebook.

Run by ``sandkernel demo`` (and scripts/demo.sh). The cells build a small sales data set in
the sandbox's workspace, summarise it with pandas, draw a chart with matplotlib, show that
state persists between calls, and show the sandbox holding (no network, read-only root).
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

from sandkernel.kernels.outputs import ExecutionStatus
from sandkernel.kernels.session import KernelSession
from sandkernel.notebooks.recorder import TranscriptRecorder

DEMO_CELLS = [
    (
        "Make a year of daily sales in the sandbox's workspace.",
        """import numpy as np, pandas as pd
rng = np.random.default_rng(7)
days = pd.date_range("2025-01-01", "2025-12-31", freq="D")
orders = pd.DataFrame({
    "date": rng.choice(days, 2000),
    "region": rng.choice(["north", "south", "east", "west"], 2000),
    "amount": rng.gamma(2.0, 40.0, 2000).round(2),
})
orders.to_csv("sales.csv", index=False)
print(f"wrote sales.csv: {len(orders)} orders")""",
    ),
    (
        "Per-quarter totals and average order value (the data frame is still in memory).",
        """orders["quarter"] = pd.PeriodIndex(orders["date"], freq="Q").astype(str)
summary = orders.groupby("quarter")["amount"].agg(total="sum", orders="count", avg_order="mean").round(2)
summary""",
    ),
    (
        "A chart, returned as a PNG and saved in the workspace.",
        """import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(6, 3))
summary["total"].plot(kind="bar", ax=ax, color="#4c72b0", title="Sales per quarter")
fig.tight_layout(); fig.savefig("report.png"); plt.show()
import os; print(sorted(os.listdir(".")))""",
    ),
    (
        "The sandbox holds: only loopback, a read-only root, an unprivileged user.",
        """import os, socket
print("interfaces:", [name for _, name in socket.if_nameindex()])
try:
    open("/etc/hacked", "w")
except OSError as err:
    print("write to /etc:", err.strerror)
print("uid:", os.getuid())""",
    ),
]


def run_demo(notebook_path: Path, runtime: str = "runc") -> int:
    """Run the demo cells, print what they return; the session's recorder writes the notebook
    after every cell (crash-safe). Returns an exit code."""
    import asyncio

    failures = asyncio.run(_run(notebook_path.resolve(), runtime))
    print(f"notebook: {notebook_path.resolve()}")
    return 1 if failures else 0


async def _run(notebook_path: Path, runtime: str) -> int:
    t0 = time.monotonic()
    recorder = TranscriptRecorder(notebook_path, {"host": platform.node(), "purpose": "sandkernel demo"})
    failures = 0
    async with await KernelSession.start(overrides={"runtime": runtime}, recorder=recorder) as session:
        print(f"sandbox ready in {time.monotonic() - t0:.2f}s (runtime {runtime}, session {session.id[:12]})\n")
        for note, code in DEMO_CELLS:
            await recorder.add_markdown(note)
            result = await session.execute(code, timeout=120, source="cli")
            images = sum("image/png" in o.get("data", {}) for o in result.outputs)
            shown = f", {images} image(s)" if images else ""
            print(f"## {note}\n[{result.status.value}, {result.duration:.2f}s{shown}]")
            print(result.text.rstrip() or "(no text output)")
            if result.error:
                print(f"{result.error.name}: {result.error.value}")
            print()
            failures += result.status is not ExecutionStatus.OK
    return failures
