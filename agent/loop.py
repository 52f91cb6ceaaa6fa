"""The Claude tool-use loop: the model plans on the host, code runs in the sandbox.

The API key and the conversation stay in this process; only tool calls reach the sandbox. The
model's text becomes markdown cells of the session notebook and every tool call a code cell
tagged with its tool-use id, so the transcript reads as the agent's lab notebook.

Why these rules: an agent that hits the same failure again and again (no network, a missing
package) burns turns; after ``replan_after`` similar failures in a row the tool result carries a
note asking the model to step back and re-plan (or report that the sandbox cannot do it), and
after ``give_up_after`` the loop stops as ``stuck``. Turns, tokens and wall time are capped.

Code the gateway's execution policy refuses (status ``refused``: nothing ran) is an error result
whose text starts with the policy's message, written for the model, so it rewrites the code
rather than retrying it; repeated refusals of one rule count toward re-planning like any repeated
failure. Policy warnings on code that ran are appended to its result, so the model learns them.

A gateway restart during a step is not the model's failure and not the end of the run: the
tool result says the step may not have finished (check before re-running), the transcript gets
a note, and the loop goes on (the client has waited for the gateway to answer again). A sandbox
the restarted gateway could not keep (``SandboxLostError``) ends the run as ``sandbox_lost``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sandkernel.agent.client import AsyncSession
from sandkernel.agent.errors import ClientError, SandboxLostError
from sandkernel.agent.tools import FINAL_ANSWER, GATEWAY_RESTARTED, MAX_RESULT_BYTES, TOOLS, ToolOutcome, run_tool
from sandkernel.truncation import clip_text

if TYPE_CHECKING:  # anthropic takes ~1.7 s to import: only the caller that makes a client pays it
    import anthropic

log = logging.getLogger(__name__)

DEFAULT_MODEL = "claude-sonnet-5"
SYSTEM_PROMPT = """You are a careful data analyst working in a Python sandbox.
You have a persistent IPython kernel: variables and imports survive between run_python calls,
so work in small steps and build on what you already computed. The user's files are in the
working directory (/workspace). There is no network access: never try to download anything.
Check your results (print shapes, heads, totals) before you report them. Save any file the
user asked for in the workspace. When you are done, or if the task cannot be done here, call
final_answer with a short, specific answer that names the files you wrote."""

REPLAN_NOTE = (
    "[sandkernel] Your last {count} tool calls failed the same way ({failure}). Stop repeating "
    "that approach. Step back and re-plan: what is the cause, and is there a different way? If "
    "the sandbox cannot do this at all (it has no network access, for example), call final_answer "
    "and say so plainly instead of retrying."
)

REFUSED = "refused"
REWRITE_NOTE = (
    "[sandkernel] This code was NOT run: the sandbox's code policy refused it before execution, so "
    "nothing in the session changed. Rewrite the code as the message above says and call the tool "
    "again; the same code would be refused again."
)
NOT_RUN_NOTE = "[sandkernel] This code was NOT run; nothing in the session changed."


@dataclasses.dataclass
class AgentConfig:
    model: str = DEFAULT_MODEL
    max_tokens: int = 4096  # per model reply
    system_prompt: str = SYSTEM_PROMPT
    max_turns: int = 20  # model calls
    max_total_tokens: int = 400_000  # input + output over the whole run
    max_seconds: float = 900.0
    replan_after: int = 2
    give_up_after: int = 4
    stream: bool = True
    tool_timeout: float = 120.0


@dataclasses.dataclass
class ToolCall:
    id: str
    name: str
    status: str
    seconds: float
    input: dict[str, Any]


@dataclasses.dataclass
class AgentRun:
    """How a run ended. ``stop`` is answer | end_turn | max_turns | max_tokens | max_seconds | stuck |
    sandbox_lost. ``gateway_restarts`` counts steps whose gateway went away under them."""

    answer: str
    stop: str
    turns: int = 0
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    replans: int = 0
    gateway_restarts: int = 0


Progress = Callable[[str, dict[str, Any]], None]


class ClaudeAgent:
    """Runs one task to an answer in one sandbox session."""

    def __init__(
        self,
        client: anthropic.AsyncAnthropic,
        session: AsyncSession,
        config: AgentConfig | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.client = client
        self.session = session
        self.config = config or AgentConfig()
        self.progress = progress or (lambda event, data: None)

    def _request(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Prompt caching: breakpoints on the system prompt and the last tool (both never change)."""
        tools = [dict(tool) for tool in TOOLS]
        tools[-1]["cache_control"] = {"type": "ephemeral"}
        return {
            "model": self.config.model,
            "max_tokens": self.config.max_tokens,
            "system": [{"type": "text", "text": self.config.system_prompt, "cache_control": {"type": "ephemeral"}}],
            "tools": tools,
            "messages": messages,
        }

    async def _ask(self, messages: list[dict[str, Any]]) -> Any:
        request = self._request(messages)
        if not self.config.stream:
            return await self.client.messages.create(**request)
        async with self.client.messages.stream(**request) as stream:
            async for event in stream:
                if event.type == "text":
                    self.progress("text_delta", {"text": event.text})
            return await stream.get_final_message()

    async def run(self, task: str) -> AgentRun:
        started = time.monotonic()
        run = AgentRun(answer="", stop="max_turns")
        try:
            await self._run(task, run, started)
        except SandboxLostError as lost:  # the gateway came back without this session's sandbox
            run.stop, run.answer = "sandbox_lost", f"Stopped: the sandbox was lost ({lost.message})."
        run.seconds = time.monotonic() - started
        self.progress("done", {"run": run})
        return run

    async def _run(self, task: str, run: AgentRun, started: float) -> None:
        config = self.config
        messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
        await self.session.add_markdown(f"## Task\n\n{task}")
        last_failure: str | None = None
        repeats = 0
        while True:
            limit = self._limit_hit(run, started)
            if limit:
                run.stop = limit
                break
            run.turns += 1
            self.progress("turn", {"turn": run.turns})
            message = await self._ask(messages)
            run.input_tokens += message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
            run.input_tokens += message.usage.cache_creation_input_tokens or 0
            run.output_tokens += message.usage.output_tokens
            content = [block.model_dump(exclude_none=True) for block in message.content]
            messages.append({"role": "assistant", "content": content})
            prose = "\n\n".join(block["text"] for block in content if block["type"] == "text" and block["text"].strip())
            if prose:
                await self.session.add_markdown(prose)
                self.progress("text", {"text": prose})
            uses = [block for block in content if block["type"] == "tool_use"]
            if not uses:
                run.answer, run.stop = prose, "end_turn"
                break
            answer = next((use for use in uses if use["name"] == FINAL_ANSWER), None)
            if answer is not None:
                run.answer, run.stop = str(answer["input"].get("answer", "")), "answer"
                await self.session.add_markdown(f"## Answer\n\n{run.answer}")
                self.progress("answer", {"answer": run.answer})
                break
            results: list[dict[str, Any]] = []
            for use in uses:
                outcome = await self._call_tool(use, run)
                results.append(outcome.block)
                if outcome.failure is None:
                    last_failure, repeats = None, 0
                elif outcome.failure == last_failure:
                    repeats += 1
                else:
                    last_failure, repeats = outcome.failure, 1
            if last_failure and repeats >= config.give_up_after:
                run.stop = "stuck"
                run.answer = f"Stopped: {repeats} tool calls in a row failed the same way ({last_failure})."
                await self.session.add_markdown(f"> **sandkernel:** {run.answer}")
                break
            if last_failure and repeats >= config.replan_after:
                note = REPLAN_NOTE.format(count=repeats, failure=last_failure)
                results.append({"type": "text", "text": note})
                run.replans += 1
                await self.session.add_markdown(
                    f"> **sandkernel:** asked the model to re-plan after {repeats} similar failures ({last_failure})."
                )
                self.progress("replan", {"failure": last_failure, "count": repeats})
            messages.append({"role": "user", "content": results})

    def _limit_hit(self, run: AgentRun, started: float) -> str | None:
        if run.turns >= self.config.max_turns:
            return "max_turns"
        if run.input_tokens + run.output_tokens >= self.config.max_total_tokens:
            return "max_tokens"
        if time.monotonic() - started >= self.config.max_seconds:
            return "max_seconds"
        return None

    async def _call_tool(self, use: dict[str, Any], run: AgentRun) -> ToolOutcome:
        self.progress("tool_start", {"id": use["id"], "name": use["name"], "input": use["input"]})
        began = time.monotonic()
        outcome = policy_view(
            await run_tool(self.session, use["id"], use["name"], use["input"], self.config.tool_timeout)
        )
        seconds = time.monotonic() - began
        run.tool_calls.append(ToolCall(use["id"], use["name"], outcome.status, seconds, use["input"]))
        self.progress("tool_end", {"id": use["id"], "name": use["name"], "status": outcome.status, "seconds": seconds})
        if outcome.status == GATEWAY_RESTARTED:
            run.gateway_restarts += 1
            self.progress("gateway_restart", {"id": use["id"], "name": use["name"]})
            with contextlib.suppress(ClientError):  # a note in the transcript is not worth ending the run
                await self.session.add_markdown(
                    f"> **sandkernel:** the gateway restarted during tool call `{use['id']}`; "
                    "the step may not have finished (the model was told to check before re-running)."
                )
        return outcome


def policy_view(outcome: ToolOutcome) -> ToolOutcome:
    """The tool result as the model should read it when the execution policy had its say.

    Refused: an error result whose text is the refusal's message first (which rule, which line,
    how to rewrite), then a note that nothing ran; its failure signature names the rule, so the
    same refusal again counts toward re-planning. Warned: the warnings follow the output."""
    execution = outcome.execution
    if execution is None:
        return outcome
    block = dict(outcome.block)
    if execution.refused:
        refusal = execution.refusal or {}
        message = str(refusal.get("message") or (execution.error.value if execution.error else "refused"))
        note = REWRITE_NOTE if refusal.get("by", "policy") == "policy" else NOT_RUN_NOTE
        text = clip_text(f"{message}\n\n{note}", MAX_RESULT_BYTES, why="to fit the tool result").text
        block.update(content=[{"type": "text", "text": text}], is_error=True)
        failure = f"refused by {refusal.get('by', 'policy')} rule {refusal.get('rule', '?')}"
        return dataclasses.replace(outcome, block=block, status=REFUSED, failure=failure)
    if not execution.warnings:
        return outcome
    warnings = "\n".join(_warning_line(warning) for warning in execution.warnings)
    content = block.get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    if parts and parts[0].get("type") == "text":
        parts[0] = {**parts[0], "text": f"{parts[0]['text']}\n\n{warnings}"}
    else:
        parts.insert(0, {"type": "text", "text": warnings})
    block["content"] = parts
    return dataclasses.replace(outcome, block=block)


def _warning_line(warning: dict[str, Any]) -> str:
    where = f", line {warning['line']}" if warning.get("line") else ""
    return f"[sandkernel policy warning{where}] {warning.get('message', '')}"
