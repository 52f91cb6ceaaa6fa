"""What a stateful session saves an agent, measured on the CSV (sales) scenario.

Three ways to run the same three analysis steps (load the CSV, aggregate per quarter, plot):

- **stateful**: the scripted agent through the real anthropic SDK, gateway and sandbox; each step
  builds on the kernel's variables (the sandkernel way);
- **fresh process, naive**: each tool call in a fresh ``python -c`` process in the same sandbox
  container (what a stateless executor gives). The same incremental code fails with NameError
  from step 2 on, and the agent must resend everything: extra tool calls and model turns;
- **fresh process, resend-all**: an agent that knows the executor is stateless and resends all
  earlier steps with each call: as many calls as stateful, but each one redoes the work.

Prints medians of --runs runs and the ratios; writes bench/results/agent_roundtrips.json.
Model latency is not included (the scripted server answers at once): every extra model turn
costs a real agent one more Claude call on top of the sandbox seconds shown.
Usage: python bench/agent_roundtrips.py [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import anthropic
from results_dir import results_path

from sandkernel.agent.loop import AgentConfig
from sandkernel.agent.offline_api import ScriptedMessagesServer
from sandkernel.agent.runner import run_task
from sandkernel.agent.scenarios import SCENARIOS
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.sandbox.container import WORKSPACE
from sandkernel.kernels.sandbox.workspace_files import WorkspaceFiles
from sandkernel.local_gateway import local_gateway

RESULTS = results_path("agent_roundtrips.json")


def scenario_steps() -> list[str]:
    turns = SCENARIOS["sales"].turns()
    return [b["input"]["code"] for t in turns for b in t.content if b.get("name") == "run_python"]


async def stateful_run(workdir: Path) -> dict:
    scenario = SCENARIOS["sales"]
    files = scenario.make_files(workdir)
    async with ScriptedMessagesServer(scenario.turns()) as server, local_gateway() as sandkernel:
        model = anthropic.AsyncAnthropic(base_url=server.url, api_key="bench", max_retries=0)
        started = time.monotonic()
        outcome = await run_task(scenario.task, sandkernel, model, files=files, config=AgentConfig())
        wall = time.monotonic() - started
    calls = outcome.run.tool_calls
    assert outcome.run.stop == "answer" and all(c.status == "ok" for c in calls)
    return {
        "tool_calls": len(calls),
        "model_turns": outcome.run.turns,
        "sandbox_seconds": sum(c.seconds for c in calls),
        "code_bytes": sum(len(c.input.get("code", "")) for c in calls),
        "wall_seconds": wall,
    }


async def fresh_process(session: KernelSession, code: str) -> tuple[bool, float]:
    """Run ``code`` in a new Python process in the sandbox container; (succeeded, seconds)."""
    api = session.container.engine.client.api

    def run() -> int:
        exec_id = api.exec_create(
            session.container.id,
            ["/opt/kernel/bin/python", "-I", "-c", code],
            user=session.container.user,
            workdir=WORKSPACE,
            environment={"MPLBACKEND": "Agg"},
        )["Id"]
        api.exec_start(exec_id, demux=True)
        return int(api.exec_inspect(exec_id).get("ExitCode") or 0)

    started = time.monotonic()
    code_exit = await session.container.engine.run(run)
    return code_exit == 0, time.monotonic() - started


async def stateless_runs(workdir: Path) -> tuple[dict, dict]:
    steps = scenario_steps()
    [csv_path] = SCENARIOS["sales"].make_files(workdir)
    async with await KernelSession.start() as session:
        await WorkspaceFiles(session.container).write("sales.csv", csv_path.read_bytes())
        # naive: incremental code; on failure the agent resends everything so far
        calls = seconds = code_bytes = 0.0
        for index, step in enumerate(steps):
            ok, took = await fresh_process(session, step)
            calls, seconds, code_bytes = calls + 1, seconds + took, code_bytes + len(step)
            if not ok:
                resend = "\n".join(steps[: index + 1])
                ok, took = await fresh_process(session, resend)
                calls, seconds, code_bytes = calls + 1, seconds + took, code_bytes + len(resend)
            assert ok, f"step {index + 1} failed even with everything resent"
        naive = {"tool_calls": calls, "model_turns": calls + 1, "sandbox_seconds": seconds, "code_bytes": code_bytes}
        # resend-all: every call carries all earlier steps
        calls = seconds = code_bytes = 0.0
        for index in range(len(steps)):
            code = "\n".join(steps[: index + 1])
            ok, took = await fresh_process(session, code)
            assert ok
            calls, seconds, code_bytes = calls + 1, seconds + took, code_bytes + len(code)
        resend = {"tool_calls": calls, "model_turns": calls + 1, "sandbox_seconds": seconds, "code_bytes": code_bytes}
    return naive, resend


def median_of(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


async def main(runs: int) -> None:
    stateful, naive, resend = [], [], []
    for index in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            stateful.append(await stateful_run(Path(tmp)))
            n, r = await stateless_runs(Path(tmp))
            naive.append(n)
            resend.append(r)
        print(f"run {index + 1}/{runs} done", flush=True)
    rows = {
        "stateful session": median_of(stateful),
        "fresh process, naive": median_of(naive),
        "fresh process, resend-all": median_of(resend),
    }
    print(f"\nCSV scenario, 3 analysis steps, median of {runs} runs (model latency excluded)")
    print(f"{'':28}{'tool calls':>11}{'model turns':>13}{'sandbox s':>11}{'code bytes':>12}")
    for name, row in rows.items():
        print(
            f"{name:28}{row['tool_calls']:>11.0f}{row['model_turns']:>13.0f}{row['sandbox_seconds']:>11.2f}"
            f"{row['code_bytes']:>12.0f}"
        )
    base = rows["stateful session"]
    for name in ("fresh process, naive", "fresh process, resend-all"):
        row = rows[name]
        print(
            f"{name}: {row['sandbox_seconds'] / base['sandbox_seconds']:.1f}x the sandbox time, "
            f"{row['tool_calls'] / base['tool_calls']:.2f}x the tool calls, "
            f"{row['code_bytes'] / base['code_bytes']:.1f}x the code the model writes"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"runs": runs, "median": rows}, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    asyncio.run(main(parser.parse_args().runs))
