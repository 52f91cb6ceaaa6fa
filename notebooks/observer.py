"""The transcript as an observer of a session: every execution, whichever door, becomes a cell.

The session layer (kernels/) emits events and knows nothing of notebooks; this adapter is what
the gateway attaches to each session to record it. Silent executions (Jupyter's ``silent=True``)
leave no cell: the door that sent one notes it (the websocket does, with the code).
"""

from __future__ import annotations

from sandkernel.kernels.execution.events import ExecutionRequest, SessionObserver
from sandkernel.kernels.execution.outputs import ExecutionResult
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.notebooks.recorder import TranscriptRecorder


class TranscriptObserver(SessionObserver):
    """Writes a session's executions and notes into its transcript, and closes it with the session."""

    def __init__(self, recorder: TranscriptRecorder) -> None:
        self.recorder = recorder

    async def execution_finished(self, request: ExecutionRequest, result: ExecutionResult) -> None:
        if not request.silent:
            await self.recorder.record(request.code, result, tag=request.tag, source=request.source)

    async def note_added(self, text: str) -> None:
        await self.recorder.note(text)

    async def session_closed(self) -> None:
        await self.recorder.close()


async def attach_transcript(session: KernelSession, recorder: TranscriptRecorder) -> TranscriptObserver:
    """Start recording ``session`` into ``recorder`` (at start, or when a pooled session is handed
    out): the sandbox's facts go in the notebook's metadata, with a running summary of its egress."""
    recorder.update_metadata(**session.describe())
    await recorder.start()
    observer = TranscriptObserver(recorder)
    session.add_observer(observer)
    proxy = session.provisioner.egress
    if proxy is not None:
        proxy.on_record = lambda _record: recorder.update_metadata(egress=proxy.summary())
    return observer
