"""Run one task end to end: a sandbox session, the user's files uploaded, the Claude loop, the
notebook saved. Shared by ``sandkernel agent``, ``sandkernel demo``, the tests and the benchmark.

It needs a gateway client; commands without a gateway URL start one in-process with
:func:`sandkernel.local_gateway.local_gateway` (the CLI layer: the agent never imports the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import anthropic
import nbformat

from sandkernel.agent.client import AsyncSandkernel, AsyncSession
from sandkernel.agent.errors import ClientError
from sandkernel.agent.loop import AgentConfig, AgentRun, ClaudeAgent, Progress
from sandkernel.atomic import write_atomic


@dataclasses.dataclass
class TaskOutcome:
    run: AgentRun
    session_id: str
    notebook: dict[str, Any]
    notebook_path: Path | None  # where the notebook was written, if asked; else the gateway's copy
    transcript: str | None  # the gateway's transcript path


async def upload_inputs(session: AsyncSession, paths: list[Path]) -> list[str]:
    """Upload files (a directory keeps its name and layout); returns the workspace paths."""
    uploaded = []
    for path in paths:
        if path.is_dir():
            for item in sorted(p for p in path.rglob("*") if p.is_file()):
                target = f"{path.name}/{item.relative_to(path).as_posix()}"
                await session.upload_file(item, target)
                uploaded.append(target)
        else:
            await session.upload_file(path)
            uploaded.append(path.name)
    return uploaded


async def run_task(
    task: str,
    sandkernel: AsyncSandkernel,
    model_client: anthropic.AsyncAnthropic,
    *,
    files: list[Path] | None = None,
    config: AgentConfig | None = None,
    progress: Progress | None = None,
    profile: str | None = None,
    limits: dict[str, Any] | None = None,
    notebook_path: Path | None = None,
    download: list[str] | None = None,
    download_to: Path | None = None,
) -> TaskOutcome:
    """Create a session, upload ``files``, run the loop, fetch the notebook (written to
    ``notebook_path`` if given) and any ``download`` files, then delete the session."""
    config = config or AgentConfig()
    metadata = {"agent": "sandkernel.agent", "model": config.model, "task": task[:500]}
    async with sandkernel.session(profile, limits=limits, metadata=metadata) as session:
        if progress:
            progress("session", {"id": session.id, "url": sandkernel.url})
        uploaded = await upload_inputs(session, files or [])
        if progress and uploaded:
            progress("uploaded", {"paths": uploaded})
        run = await ClaudeAgent(model_client, session, config, progress).run(task)
        notebook = await session.notebook()
        for name in download or []:
            with contextlib.suppress(ClientError):  # a file the agent did not write
                data = await session.download(name)
                (download_to or Path.cwd()).joinpath(Path(name).name).write_bytes(data)
    if notebook_path is not None:  # the gateway's transcript, validated when it was written there
        await asyncio.to_thread(write_atomic, notebook_path, nbformat.writes(nbformat.from_dict(notebook)) + "\n")
    return TaskOutcome(run, session.id, notebook, notebook_path, session.info.get("path"))
