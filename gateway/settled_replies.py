"""The ``execute_reply`` of a websocket execute that a gateway restart cut off from its client.

A Jupyter client (JupyterLab through ``--gateway-url``) marks a cell done when its
``execute_reply`` arrives on shell. The kernel sends that reply to the socket the request came
from, which belonged to the gateway process that is gone, so after a restart the reply is lost
although the kernel finished the cell: the browser would show the cell running forever. The
next gateway settles that execution (KernelSession.resume) and, when it ends, this observer
answers it on every websocket of the kernel, then or as soon as one (re)connects: a reply
parented by the request's msg_id, which is all a client matches on. A client that does not know
the msg_id ignores it, as it ignores any reply to another client's request.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Set
from typing import TYPE_CHECKING, Any, Protocol

from sandkernel.kernels.execution.events import ExecutionRequest, SessionObserver
from sandkernel.kernels.execution.outputs import ExecutionResult, ExecutionStatus

if TYPE_CHECKING:
    from sandkernel.gateway.managed import ManagedSession


class KernelWebsocket(Protocol):
    """What this observer asks of an open kernel websocket (gateway/channels.py's handler)."""

    managed: ManagedSession | None

    def deliver_settled_replies(self) -> None: ...


Websockets = Set[KernelWebsocket]  # the server's open kernel websockets

# How many settled replies a session keeps for websockets that have not reconnected yet.
MAX_PENDING = 8


def settled_reply(request: ExecutionRequest, result: ExecutionResult) -> dict[str, Any]:
    """The shell message a client waits for, from what the settling observed."""
    if result.status is ExecutionStatus.OK:
        content: dict[str, Any] = {"status": "ok", "execution_count": result.execution_count}
    elif result.status is ExecutionStatus.ERROR and result.error is not None:
        error = result.error
        content = {
            "status": "error",
            "execution_count": result.execution_count,
            "ename": error.name,
            "evalue": error.value,
            "traceback": list(error.traceback),
        }
    else:  # ended unwatched, timed out, died: nothing a client can take for a result
        content = {"status": "aborted", "execution_count": result.execution_count}
    return {
        "channel": "shell",
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": "execute_reply",
            "session": "sandkernel-gateway",
            "username": "sandkernel",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(),
            "version": "5.3",
        },
        "parent_header": {"msg_id": request.msg_id, "msg_type": "execute_request"},
        "metadata": {"sandkernel": {"settled_after_gateway_restart": True, "status": result.status.value}},
        "content": content,
        "buffers": [],
    }


class SettledReplies(SessionObserver):
    """Answers the websocket execute a previous gateway process left running (see the module)."""

    def __init__(self, managed: ManagedSession, websockets: Websockets, msg_id: str) -> None:
        self.managed = managed
        self.websockets = websockets
        self.msg_id = msg_id

    async def execution_finished(self, request: ExecutionRequest, result: ExecutionResult) -> None:
        if request.msg_id != self.msg_id:
            return
        self.managed.session.remove_observer(self)
        pending = self.managed.settled_replies
        pending.append(settled_reply(request, result))
        del pending[:-MAX_PENDING]
        for handler in list(self.websockets):
            if handler.managed is self.managed:
                handler.deliver_settled_replies()
