"""What was taken off the execute round trip (issue 17) changed no behaviour: received headers keep
their dates as strings but signatures are still checked, results serialise as before, and a door
answered before the observers still has every execution recorded."""

from __future__ import annotations

import dataclasses

import pytest
from jupyter_client.session import Session

from sandkernel.kernels.execution.events import ExecutionRequest, SessionObserver
from sandkernel.kernels.execution.outputs import ErrorInfo, ExecutionResult, ExecutionStatus, TimeoutStep
from sandkernel.kernels.execution.transport import DatelessSession


def _frames(key: bytes = b"k") -> list[bytes]:
    sender = Session(key=key)
    parent = sender.msg("execute_request", {"code": "1+1"})["header"]
    parent["date"] = "2026-01-01T00:00:00.123Z"  # as JupyterLab writes it (milliseconds)
    msg = sender.msg("status", {"execution_state": "idle"}, parent=parent)
    return sender.serialize(msg)[1:]  # without the delimiter's identities


def test_dateless_session_reads_what_jupyter_client_reads_but_the_dates():
    frames = _frames()
    ours, theirs = DatelessSession(key=b"k").deserialize(frames), Session(key=b"k").deserialize(frames)
    assert isinstance(ours["header"]["date"], str)
    assert ours["parent_header"]["date"] == "2026-01-01T00:00:00.123Z"  # passed on as the client wrote it
    for field in ("msg_id", "msg_type", "metadata", "content", "buffers"):
        assert ours[field] == theirs[field]
    assert {k: v for k, v in ours["header"].items() if k != "date"} == {
        k: v for k, v in theirs["header"].items() if k != "date"
    }


def test_dateless_session_still_refuses_forged_and_replayed_messages():
    frames = _frames()
    session = DatelessSession(key=b"k")
    forged = [*frames[:4], b'{"execution_state": "busy"}']
    with pytest.raises(ValueError, match="Invalid Signature"):
        session.deserialize(forged)
    with pytest.raises(ValueError, match="Invalid Signature"):
        DatelessSession(key=b"another").deserialize(frames)
    session = DatelessSession(key=b"k")  # (a refused signature is used up, as in jupyter_client)
    session.deserialize(frames)
    with pytest.raises(ValueError, match="Duplicate Signature"):
        session.deserialize(frames)
    assert type(session.clone()) is DatelessSession  # relays clone the kernel manager's session


@pytest.mark.parametrize(
    "result",
    [
        ExecutionResult(
            ExecutionStatus.OK,
            ({"output_type": "execute_result", "data": {"text/plain": "2"}, "metadata": {}, "execution_count": 1},),
            1,
            "2026-01-01T00:00:00+00:00",
            0.001,
            accounting={"cpu_seconds": 0.1, "files": {"written": [["a", 1]]}, "packages": None},
        ),
        ExecutionResult(
            ExecutionStatus.TIMEOUT,
            (),
            None,
            "t",
            1.0,
            error=ErrorInfo("E", "v", ("a", "b")),
            ended_by=TimeoutStep.KILL,
            state_lost="lost",
            chars_cut=3,
            outputs_dropped=1,
            bytes_omitted=2,
            policy=({"rule": "r", "action": "warn"},),
            refusal={"by": "policy", "rule": "r"},
        ),
    ],
)
def test_result_to_dict_is_what_asdict_made(result):
    expected = dataclasses.asdict(result)
    expected.update(status=result.status.value, ended_by=result.ended_by.value if result.ended_by else None)
    expected.update(outputs=list(result.outputs), policy=list(result.policy))
    if result.error:
        expected["error"]["traceback"] = list(result.error.traceback)
    data = result.to_dict()
    assert data == expected and list(data) == list(expected)
    if result.accounting:  # a copy: the caller may change it
        data["accounting"]["files"]["written"].append(["b", 2])
        assert result.accounting["files"]["written"] == [["a", 1]]


def test_request_to_dict_is_what_asdict_made():
    request = ExecutionRequest("1+1", "session_api", "m", 30.0, "t", False, "2026", "ls")
    assert request.to_dict() == dataclasses.asdict(request)


class _Events(SessionObserver):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def execution_finished(self, request: ExecutionRequest, result: ExecutionResult) -> None:
        self.log.append(f"finished {result.execution_count}")


async def test_the_door_answers_before_the_observers_and_they_still_record(kernel_session):
    log: list[str] = []
    observer = _Events(log)
    kernel_session.add_observer(observer)
    try:
        result = await kernel_session.execute("1+1", on_result=lambda r: log.append(f"answered {r.execution_count}"))
        assert log == [f"answered {result.execution_count}", f"finished {result.execution_count}"]

        def broken(result: ExecutionResult) -> None:
            raise ConnectionResetError("the client went away")

        with pytest.raises(ConnectionResetError):
            await kernel_session.execute("2+2", on_result=broken)
        assert log[-1] == f"finished {result.execution_count + 1}"  # recorded all the same
    finally:
        kernel_session.remove_observer(observer)
