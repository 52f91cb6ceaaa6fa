"""Which session an MCP request over HTTP names (gateway/mcp/http.py's ``session_named``): in a
cluster, a modern request naming a session another host holds is forwarded there
(tests/test_forwarding.py proves it end to end); anything else is answered where it lands."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sandkernel.gateway.mcp.http import session_named
from sandkernel.gateway.mcp.tools import NOTEBOOK_URI, notebook_session


def message(method: str, params: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).encode()


def test_a_tool_call_names_its_session_id_argument() -> None:
    body = message("tools/call", {"name": "run_python", "arguments": {"code": "1", "session_id": "ab12"}})
    assert session_named(body) == "ab12"


def test_the_notebook_resource_names_its_session() -> None:
    uri = NOTEBOOK_URI.format(session_id="ab12")
    assert notebook_session(uri) == "ab12"
    assert session_named(message("resources/read", {"uri": uri})) == "ab12"


@pytest.mark.parametrize(
    "body",
    [
        message("tools/call", {"name": "run_python", "arguments": {"code": "1"}}),  # the default session
        message("tools/call", {"name": "run_python", "arguments": {"session_id": 7}}),
        message("tools/call", {"name": "run_python", "arguments": {"session_id": ""}}),
        message("tools/call", {"name": "run_python", "arguments": {"session_id": "a" * 65}}),
        message("tools/call", {"name": "run_python", "arguments": ["session_id"]}),
        message("tools/call", None),
        message("tools/list", {}),
        message("resources/read", {"uri": "sandkernel://sessions/ab/cd/notebook"}),
        message("resources/read", {"uri": "file:///etc/passwd"}),
        message("resources/read", {"uri": None}),
        json.dumps([json.loads(message("tools/call", {"arguments": {"session_id": "ab12"}}))]).encode(),  # a batch
        b"{not json",
        b"[" * 200_000,  # nested past the parser's depth (RecursionError, not ValueError)
        b"\xff\xfe",
        b"",
    ],
)
def test_anything_else_names_no_session_and_is_answered_where_it_lands(body: bytes) -> None:
    assert session_named(body) is None
