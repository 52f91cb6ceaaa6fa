"""``sandkernel agent "TASK"``: run a task with Claude in a fresh sandbox, with live progress.

The model is called from this process (``ANTHROPIC_API_KEY`` stays here); only code reaches the
sandbox. Without ``--url`` a gateway runs in-process for the duration of the task.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TextIO

from sandkernel.agent.errors import ClientError
from sandkernel.agent.loop import DEFAULT_MODEL, AgentConfig, AgentRun

NO_KEY_MESSAGE = """sandkernel agent: ANTHROPIC_API_KEY is not set.
The agent calls Claude from this machine (the key never enters the sandbox). Set it:
    export ANTHROPIC_API_KEY=sk-ant-...
or watch a scripted run that needs no key: sandkernel demo"""


class ProgressPrinter:
    """Live progress lines: elapsed time, model turns, tool calls with their status and duration."""

    def __init__(self, out: TextIO = sys.stdout, model: str = "") -> None:
        self.out = out
        self.model = model
        self.started = time.monotonic()

    def line(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {text}", file=self.out, flush=True)

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "session":
            self.line(f"sandbox ready: session {data['id'][:12]} at {data['url']}")
        elif kind == "uploaded":
            self.line(f"uploaded to the workspace: {', '.join(data['paths'])}")
        elif kind == "turn":
            self.line(f"turn {data['turn']}: asking {self.model or 'the model'}")
        elif kind == "text":
            first = data["text"].strip().splitlines()[0]
            self.line(f"  {first[:110]}{'…' if len(first) > 110 else ''}")
        elif kind == "tool_start":
            summary = _summarise(data["name"], data["input"])
            self.line(f"  → {data['name']}  {summary}")
        elif kind == "tool_end":
            mark = "✓" if data["status"] == "ok" else "✗"
            self.line(f"  {mark} {data['status']} in {data['seconds']:.2f}s")
        elif kind == "gateway_restart":
            self.line("  ! the gateway restarted during this step: the model was told it may not have finished")
        elif kind == "replan":
            self.line(f"  ! {data['count']} similar failures ({data['failure']}): asked the model to re-plan")
        elif kind == "done":
            run: AgentRun = data["run"]
            self.line(
                f"stopped: {run.stop} after {run.turns} turns, {len(run.tool_calls)} tool calls, "
                f"{run.input_tokens + run.output_tokens:,} tokens"
            )


def _summarise(name: str, tool_input: dict[str, Any]) -> str:
    if name == "run_python":
        lines = [line for line in str(tool_input.get("code", "")).splitlines() if line.strip()]
        return (lines[0][:80] if lines else "") + (f"  (+{len(lines) - 1} lines)" if len(lines) > 1 else "")
    return str(tool_input.get("path", ""))


# Starts a gateway in this process and yields a client for it (the CLI layer's local_gateway):
# handed in by the command line, so the agent package never imports the server.
LocalGateway = Callable[[], AbstractAsyncContextManager[Any]]


def add_parser(sub: Any, local_gateway: LocalGateway | None = None) -> None:
    """Add ``sandkernel agent``; ``local_gateway`` serves tasks run without ``--url``."""
    agent = sub.add_parser(
        "agent",
        help="run a task with Claude in a fresh sandbox and leave its notebook",
        description="Run TASK with Claude: the model plans on this machine, its code runs in a sandboxed kernel "
        "whose state persists between tool calls. Prints live progress and the answer, and leaves the session's "
        "notebook. Needs ANTHROPIC_API_KEY.",
        epilog='example: sandkernel agent "Which region grew fastest?" --file sales.csv --notebook run.ipynb',
    )
    agent.add_argument("task", help="what to do, in plain words")
    agent.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="PATH",
        help="a file or directory to upload into the workspace first (repeatable)",
    )
    agent.add_argument("--notebook", default=None, metavar="PATH", help="also write the session notebook here")
    agent.add_argument(
        "--download", action="append", default=[], metavar="NAME", help="copy this workspace file here at the end"
    )
    agent.add_argument(
        "--url", metavar="URL", default=None, help="gateway URL ($SANDKERNEL_URL; default: a gateway in-process)"
    )
    agent.add_argument("--token", metavar="TOKEN", default=None, help="gateway token ($SANDKERNEL_TOKEN)")
    agent.add_argument("--profile", metavar="NAME", default=None, help="sandbox profile: default, small or large")
    agent.add_argument(
        "--model", metavar="NAME", default=None, help=f"Claude model ($SANDKERNEL_MODEL; default {DEFAULT_MODEL})"
    )
    agent.add_argument(
        "--max-tokens", type=int, metavar="N", default=4096, help="tokens per model reply (default 4096)"
    )
    agent.add_argument(
        "--max-turns", type=int, metavar="N", default=20, help="model calls before stopping (default 20)"
    )
    agent.add_argument("--token-budget", type=int, metavar="N", default=400_000, help="total tokens before stopping")
    agent.add_argument(
        "--time-limit", type=float, metavar="SECONDS", default=900, help="seconds before stopping (default 900)"
    )
    agent.add_argument("--system-prompt", default=None, metavar="FILE", help="replace the system prompt")
    agent.add_argument("--no-stream", action="store_true", help="ask for whole replies instead of streaming")
    agent.set_defaults(func=run_agent_command, local_gateway=local_gateway)


@contextlib.asynccontextmanager
async def gateway_client(
    url: str | None, token: str | None, local_gateway: LocalGateway | None = None
) -> AsyncIterator[Any]:
    """A client for ``url``, or for a gateway started in this process when there is none."""
    from sandkernel.agent.client import AsyncSandkernel

    url = url or os.environ.get("SANDKERNEL_URL")
    if url:
        async with AsyncSandkernel(url, token) as client:
            yield client
    elif local_gateway is not None:
        async with local_gateway() as client:
            yield client
    else:
        raise ClientError("no gateway: give --url (or set SANDKERNEL_URL)")


def print_outcome(outcome: Any, out: TextIO = sys.stdout) -> None:
    print(f"\n{outcome.run.answer or '(no answer)'}\n", file=out)
    where = outcome.notebook_path or outcome.transcript
    print(f"notebook: {where}", file=out)


def run_agent_command(args: argparse.Namespace) -> int:
    import anthropic

    from sandkernel.agent.runner import run_task

    if not (os.environ.get("ANTHROPIC_API_KEY") or os.environ.get("ANTHROPIC_AUTH_TOKEN")):
        print(NO_KEY_MESSAGE, file=sys.stderr)
        return 2
    missing = [name for name in args.file if not Path(name).exists()]
    if missing:
        print(f"sandkernel agent: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    config = AgentConfig(
        model=args.model or os.environ.get("SANDKERNEL_MODEL") or DEFAULT_MODEL,
        max_tokens=args.max_tokens,
        max_turns=args.max_turns,
        max_total_tokens=args.token_budget,
        max_seconds=args.time_limit,
        stream=not args.no_stream,
    )
    if args.system_prompt:
        config.system_prompt = Path(args.system_prompt).read_text()
    progress = ProgressPrinter(model=config.model)

    async def main() -> int:
        async with gateway_client(args.url, args.token, getattr(args, "local_gateway", None)) as client:
            outcome = await run_task(
                args.task,
                client,
                anthropic.AsyncAnthropic(),
                files=[Path(f) for f in args.file],
                config=config,
                progress=progress,
                profile=args.profile,
                notebook_path=Path(args.notebook) if args.notebook else None,
                download=args.download,
            )
        print_outcome(outcome)
        return 0 if outcome.run.stop in ("answer", "end_turn") else 1

    try:
        return asyncio.run(main())
    except anthropic.AuthenticationError as err:
        print(f"sandkernel agent: Claude refused the API key ({err.message}); check ANTHROPIC_API_KEY", file=sys.stderr)
        return 2
    except anthropic.APIConnectionError as err:
        print(f"sandkernel agent: cannot reach the Claude API: {err}", file=sys.stderr)
        return 2
    except ClientError as err:
        print(f"sandkernel agent: {err}", file=sys.stderr)
        return 2
