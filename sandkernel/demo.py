"""The main job: an agent analyses a sales CSV in a sandbox and leaves its notebook.

Run by ``sandkernel demo`` (and scripts/demo.sh). With ``ANTHROPIC_API_KEY`` set, Claude does
the task; without it, the scripted conversation of the sales scenario is played by the local
offline Messages API server through the real ``anthropic`` SDK. Either way the code runs for
real in a sandboxed kernel behind an in-process gateway, report.png is copied out, and the
session's notebook is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import anthropic

from sandkernel.agent.cli import ProgressPrinter, print_outcome
from sandkernel.agent.loop import DEFAULT_MODEL, AgentConfig
from sandkernel.agent.offline_api import ScriptedMessagesServer
from sandkernel.agent.runner import run_task
from sandkernel.agent.scenarios import SCENARIOS
from sandkernel.local_gateway import local_gateway

OFFLINE_NOTICE = (
    "ANTHROPIC_API_KEY is not set: playing a scripted conversation from a local offline Messages API\n"
    "server instead of Claude. The code still runs for real in the sandbox. Set ANTHROPIC_API_KEY to\n"
    "let Claude do the task."
)


@contextlib.asynccontextmanager
async def model_client(scenario_name: str) -> AsyncIterator[tuple[anthropic.AsyncAnthropic, str]]:
    if os.environ.get("ANTHROPIC_API_KEY"):
        yield anthropic.AsyncAnthropic(), os.environ.get("SANDKERNEL_MODEL") or DEFAULT_MODEL
        return
    print(OFFLINE_NOTICE, flush=True)
    async with ScriptedMessagesServer(SCENARIOS[scenario_name].turns()) as server:
        yield anthropic.AsyncAnthropic(base_url=server.url, api_key="offline"), "scripted (offline)"


async def _run(notebook_path: Path, workdir: Path, runtime: str) -> int:
    scenario = SCENARIOS["sales"]
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    files = await asyncio.to_thread(scenario.make_files, workdir)
    async with model_client(scenario.name) as (client, model), local_gateway(default_runtime=runtime) as sandkernel:
        progress = ProgressPrinter(model=model)
        print(f"task: {scenario.task}\n", flush=True)
        outcome = await run_task(
            scenario.task,
            sandkernel,
            client,
            files=files,
            config=AgentConfig(model=model if "offline" not in model else DEFAULT_MODEL),
            progress=progress,
            notebook_path=notebook_path,
            download=["report.png"],
            download_to=workdir,
        )
    print_outcome(outcome)
    if (workdir / "report.png").exists():
        print(f"chart: {workdir / 'report.png'}")
    return 0 if outcome.run.stop == "answer" else 1


def run_demo(notebook_path: Path, runtime: str = "auto", workdir: Path | None = None) -> int:
    """Returns an exit code: 0 when the agent answered."""
    return asyncio.run(_run(notebook_path.resolve(), (workdir or Path("sandkernel-demo")).resolve(), runtime))
