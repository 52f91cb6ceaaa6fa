"""The Claude loop end to end: the real ``anthropic`` SDK pointed at the local scripted Messages
API server, a real gateway, real containers. Each scenario leaves a valid notebook whose code
cells replay to the same outputs in a fresh sandbox."""

from __future__ import annotations

import asyncio
import csv
import io
import json

import anthropic
import nbformat
import pytest

from sandkernel.agent.client import AsyncSandkernel
from sandkernel.agent.loop import AgentConfig, ClaudeAgent
from sandkernel.agent.offline_api import ScriptedMessagesServer, ScriptedTurn, call, say
from sandkernel.agent.runner import run_task
from sandkernel.agent.scenarios import LOG_FILES, SALES_ROWS, SCENARIOS, sales_by_quarter
from sandkernel.notebooks.replay import replay_notebook

from .gateway_fixtures import ALICE, gateway_fixture

pytestmark = pytest.mark.docker


gateway = gateway_fixture()


@pytest.fixture(scope="module")
async def sandkernel(gateway):
    async with AsyncSandkernel(gateway.url, ALICE) as client:
        yield client


async def play(scenario_name, sandkernel, tmp_path, stream=True, **config):
    scenario = SCENARIOS[scenario_name]
    files = scenario.make_files(tmp_path)
    events = []
    async with ScriptedMessagesServer(scenario.turns()) as server:
        model = anthropic.AsyncAnthropic(base_url=server.url, api_key="offline-test", max_retries=0)
        outcome = await run_task(
            scenario.task,
            sandkernel,
            model,
            files=files,
            config=AgentConfig(stream=stream, **config),
            progress=lambda kind, data: events.append((kind, data)),
            notebook_path=tmp_path / f"{scenario_name}.ipynb",
            download=["report.png", "error_summary.csv"],
            download_to=tmp_path,
        )
    return outcome, server, events


def code_cells(notebook):
    return [c for c in notebook["cells"] if c["cell_type"] == "code"]


def assert_replays_the_same(path):
    cells = code_cells(nbformat.read(path, as_version=4))
    _, verdicts = replay_notebook(path)
    assert [v.verdict for v in verdicts] == ["same"] * len(cells), [(v.index, v.verdict, v.diff) for v in verdicts]


@pytest.mark.smoke  # the quick tier's check of this door (scripts/test.sh --quick)
async def test_sales_scenario_report_and_chart_back_to_the_model(sandkernel, tmp_path):
    outcome, server, events = await play("sales", sandkernel, tmp_path)
    run = outcome.run
    assert run.stop == "answer" and run.turns == 4
    assert [c.name for c in run.tool_calls] == ["run_python"] * 3 and all(c.status == "ok" for c in run.tool_calls)
    # The chart went back to the model as an image block (the script's turn 4 checks it too).
    last = server.requests[-1]["messages"][-1]["content"][0]
    image = next(part for part in last["content"] if part["type"] == "image")
    assert image["source"]["media_type"] == "image/png" and len(image["source"]["data"]) > 1000
    # The answer's numbers are what the sandbox computed; report.png is a real PNG.
    expected = sales_by_quarter()
    assert "2025Q4" in run.answer and f"{expected['2025Q4']['total']:,.2f}" in run.answer
    assert (tmp_path / "report.png").read_bytes().startswith(b"\x89PNG")
    # Prompt caching: the system prompt and the last tool carry cache_control.
    first = server.requests[0]
    assert first["system"][0]["cache_control"] == {"type": "ephemeral"} and "cache_control" in first["tools"][-1]
    # The notebook: task, prose as markdown, each tool call a code cell tagged with its tool-use id.
    nb = nbformat.read(outcome.notebook_path, as_version=4)
    nbformat.validate(nb)
    cells = code_cells(nb)
    assert [c.metadata["sandkernel"]["tag"] for c in cells] == [c.id for c in run.tool_calls]
    assert f"({SALES_ROWS}, 4)" in cells[0].outputs[0]["text"]
    markdown = [c.source for c in nb.cells if c.cell_type == "markdown"]
    assert markdown[0].startswith("## Task") and markdown[-1].startswith("## Answer")
    assert any("per-quarter totals" in text for text in markdown)
    assert nb.metadata["sandkernel"]["inputs"][0]["path"] == "sales.csv"
    kinds = [kind for kind, _ in events]
    assert kinds.count("tool_start") == 3 and kinds[-1] == "done" and "text_delta" in kinds
    await asyncio.to_thread(assert_replays_the_same, outcome.notebook_path)


async def test_logs_scenario_recovers_from_a_decode_error(sandkernel, tmp_path):
    outcome, server, _ = await play("logs", sandkernel, tmp_path, stream=False)
    run = outcome.run
    assert run.stop == "answer" and [c.status for c in run.tool_calls] == ["error", "ok"]
    assert run.replans == 0  # one failure is not a pattern
    rows = list(csv.DictReader(io.StringIO((tmp_path / "error_summary.csv").read_text())))
    assert {r["file"]: int(r["error_lines"]) for r in rows} == {n: e for n, (_, e) in LOG_FILES.items()}
    assert {r["file"]: r["encoding"] for r in rows}["worker.log"] == "utf-16"
    first_result = server.requests[1]["messages"][-1]["content"][0]
    assert first_result["is_error"] is True and "UnicodeDecodeError" in first_result["content"][0]["text"]
    nb = nbformat.read(outcome.notebook_path, as_version=4)
    nbformat.validate(nb)
    assert [c.metadata["sandkernel"]["status"] for c in code_cells(nb)] == ["error", "ok"]
    assert len(nb.metadata["sandkernel"]["inputs"]) == len(LOG_FILES)
    await asyncio.to_thread(assert_replays_the_same, outcome.notebook_path)


async def test_network_scenario_reports_instead_of_retrying(sandkernel, tmp_path):
    outcome, server, events = await play("network", sandkernel, tmp_path)
    run = outcome.run
    assert run.stop == "answer" and len(run.tool_calls) == 2
    assert all(c.status == "error" for c in run.tool_calls)
    assert run.replans == 1 and ("replan", {"failure": "URLError", "count": 2}) in events
    assert "no network access" in run.answer
    errors = [json.dumps(m["content"]) for m in server.requests[1:] for m in [m["messages"][-1]]]
    assert all("URLError" in text for text in errors)
    nb = nbformat.read(outcome.notebook_path, as_version=4)
    nbformat.validate(nb)
    assert any("re-plan" in c.source for c in nb.cells if c.cell_type == "markdown")
    await asyncio.to_thread(assert_replays_the_same, outcome.notebook_path)


async def test_loop_limits_stop_a_model_that_never_finishes(sandkernel):
    forever = [ScriptedTurn([say("Still working."), call("run_python", code="x = 1")])]
    async with ScriptedMessagesServer(forever, repeat_last=True) as server, sandkernel.session(profile="small") as s:
        model = anthropic.AsyncAnthropic(base_url=server.url, api_key="offline-test", max_retries=0)
        run = await ClaudeAgent(model, s, AgentConfig(max_turns=3)).run("loop forever")
        assert run.stop == "max_turns" and run.turns == 3 and len(server.requests) == 3
        run = await ClaudeAgent(model, s, AgentConfig(max_total_tokens=1)).run("loop forever")
        assert run.stop == "max_tokens" and run.turns == 1
        run = await ClaudeAgent(model, s, AgentConfig(max_seconds=0)).run("loop forever")
        assert run.stop == "max_seconds" and run.turns == 0
        assert len(server.requests) == 4  # the time limit stopped it before any model call


async def test_repeated_failures_stop_as_stuck(sandkernel):
    failing = [ScriptedTurn([call("run_python", code="import not_a_module")])]
    async with ScriptedMessagesServer(failing, repeat_last=True) as server, sandkernel.session(profile="small") as s:
        model = anthropic.AsyncAnthropic(base_url=server.url, api_key="offline-test", max_retries=0)
        run = await ClaudeAgent(model, s, AgentConfig(replan_after=2, give_up_after=3)).run("import it")
        assert run.stop == "stuck" and len(run.tool_calls) == 3 and run.replans == 1
        assert "ModuleNotFoundError" in run.answer
        assert "Stop repeating" in json.dumps(server.requests[2]["messages"][-1])


async def test_offline_server_refuses_what_the_real_api_would(sandkernel):
    async with ScriptedMessagesServer([ScriptedTurn([say("hi")])]) as server:
        model = anthropic.AsyncAnthropic(base_url=server.url, api_key="offline-test", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as err:
            await model.messages.create(
                model="m",
                max_tokens=10,
                messages=[
                    {"role": "user", "content": "go"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "x", "input": {}}]},
                    {"role": "user", "content": "no result"},
                ],
            )
        assert "without tool_result" in str(err.value)


async def test_malformed_tool_calls_get_error_results_and_the_loop_goes_on(sandkernel):
    turns = [
        ScriptedTurn([call("delete_everything", path="/"), call("run_python", code="   ")]),
        ScriptedTurn([call("run_python", code="print('still here')")]),
        ScriptedTurn([call("final_answer", answer="done")]),
    ]
    async with ScriptedMessagesServer(turns) as server, sandkernel.session(profile="small") as s:
        model = anthropic.AsyncAnthropic(base_url=server.url, api_key="offline-test", max_retries=0)
        run = await ClaudeAgent(model, s, AgentConfig(stream=False)).run("misbehave")
        assert run.stop == "answer" and run.answer == "done"
        first = server.requests[1]["messages"][-1]["content"]
        assert [b["is_error"] for b in first] == [True, True]
        assert "unknown tool 'delete_everything'" in first[0]["content"] and "non-empty 'code'" in first[1]["content"]
        assert "still here" in json.dumps(server.requests[2]["messages"][-1])
        nb = await s.notebook()
        assert [c["source"] for c in nb["cells"] if c["cell_type"] == "code"] == ["print('still here')"]
