"""Errors are mapped once: every SandkernelError carries its status and code, and the base handler
turns any exception into the same JSON. Pure logic plus a real tornado server on loopback (no
engine, no image)."""

from __future__ import annotations

import json
import logging
import socket

import pytest
from tornado import httpserver, web
from tornado.httpclient import AsyncHTTPClient

import sandkernel.gateway.registry
import sandkernel.kernels.egress.policy
import sandkernel.kernels.sandbox.workspace_files  # noqa: F401  (defines SandkernelErrors)
from sandkernel.errors import (
    ConfigError,
    DockerUnavailableError,
    KernelNotFoundError,
    SandkernelError,
    SessionClosedError,
    SettingNotPermittedError,
    UnknownProfileError,
)
from sandkernel.gateway.base import INTERNAL_ERROR, BaseHandler, error_reply
from sandkernel.gateway.http_api import ApiError
from sandkernel.gateway.managed import TooManySessionsError
from sandkernel.gateway.metrics import GatewayMetrics
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.kernels.sandbox.workspace_files import WorkspaceFileError


def every_error_class() -> list[type[SandkernelError]]:
    found, todo = [], [SandkernelError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def instance(cls: type[SandkernelError]) -> SandkernelError:
    try:
        return cls("what went wrong")
    except TypeError:  # errors whose instances carry their own code (WorkspaceFileError)
        return cls("bad_path", "what went wrong")  # type: ignore[call-arg]


@pytest.mark.parametrize("cls", every_error_class(), ids=lambda cls: cls.__name__)
def test_every_sandkernel_error_maps_to_an_error_status_with_a_code(cls):
    err = instance(cls)
    status, code, message = error_reply(err)
    assert 400 <= status <= 599 and status == err.http_status
    assert code and code.replace("_", "").isalnum() and code == code.lower() and code == err.code
    assert message == "what went wrong"


def test_the_statuses_that_matter():
    assert error_reply(SessionClosedError("session s is shut down; start a new session")) == (
        404,
        "session_closed",
        "session s is shut down; start a new session",
    )
    assert error_reply(KernelNotFoundError("no session 'x'"))[:2] == (404, "not_found")
    assert error_reply(TooManySessionsError("limit"))[:2] == (429, "toomanysessions")
    assert error_reply(SettingNotPermittedError("image"))[:2] == (403, "not_permitted")
    assert error_reply(UnknownProfileError("nope"))[:2] == (400, "unknownprofile")  # codes clients already see
    assert error_reply(ConfigError("bad"))[:2] == (400, "config")
    assert error_reply(DockerUnavailableError("down"))[:2] == (503, "dockerunavailable")
    assert error_reply(WorkspaceFileError("not_found", "no file 'a'"))[:2] == (404, "not_found")
    assert error_reply(WorkspaceFileError("too_large", "big"))[:2] == (413, "too_large")
    assert error_reply(WorkspaceFileError("bad_path", "outside"))[:2] == (400, "bad_path")
    refusal = ApiError(400, "'code' must be a string", "bad_code")
    assert error_reply(refusal) == (400, "bad_code", "'code' must be a string")
    assert error_reply(RuntimeError("secret detail")) == INTERNAL_ERROR


def test_shared_codes_agree_with_their_classes():
    """A class whose code is one of the shared codes has that code's status (one fact, not two)."""
    from sandkernel.errors import STATUS_FOR_CODE

    for cls in every_error_class():
        if cls.code in STATUS_FOR_CODE:
            assert cls.status == STATUS_FOR_CODE[cls.code], cls


class Raising(BaseHandler):
    """Raises what the path names: the way a real handler lets the session layer's errors through."""

    def authenticate(self) -> str:
        return "anonymous"

    async def get(self, what: str) -> None:
        errors = {
            "closed": SessionClosedError("session abc is shut down; start a new session"),
            "missing": KernelNotFoundError("no session 'abc'"),
            "refused": ApiError(400, "'code' must be a string", "bad_code"),
            "docker": DockerUnavailableError("cannot reach the Docker engine"),
            "bug": RuntimeError("secret detail of a bug"),
        }
        raise errors[what]


@pytest.fixture
async def raising_server():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    deps = {"registry": None, "auth": None, "settings": GatewaySettings(), "service": None, "metrics": GatewayMetrics()}
    server = httpserver.HTTPServer(web.Application([(r"/(?P<what>\w+)", Raising, deps)]))
    server.listen(port, address="127.0.0.1")
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.mark.parametrize(
    ("what", "status", "code", "words"),
    [
        ("closed", 404, "session_closed", "is shut down; start a new session"),
        ("missing", 404, "not_found", "no session 'abc'"),
        ("refused", 400, "bad_code", "'code' must be a string"),
        ("docker", 503, "dockerunavailable", "cannot reach the Docker engine"),
        ("bug", 500, "internal_error", "it has been logged"),
    ],
)
async def test_the_base_handler_answers_json_and_logs_only_5xx(raising_server, caplog, what, status, code, words):
    caplog.set_level(logging.INFO, logger="sandkernel.gateway.base")
    response = await AsyncHTTPClient().fetch(f"{raising_server}/{what}", raise_error=False)
    body = json.loads(response.body)
    assert (response.code, body["error"]) == (status, code) and words in body["message"]
    assert response.headers["Content-Type"] == "application/json"
    assert "Traceback" not in response.body.decode() and "secret detail" not in response.body.decode()
    logged = [r for r in caplog.records if r.name == "sandkernel.gateway.base"]
    if status < 500:
        assert logged == []  # a refusal is the client's business
    elif what == "bug":
        [record] = logged  # one line, with the traceback: a bug
        assert record.levelno == logging.ERROR and record.exc_info and "secret detail" in str(record.exc_info[1])
    else:
        [record] = logged  # an infrastructure failure: one line, no traceback
        assert record.levelno == logging.ERROR and not record.exc_info and words in record.getMessage()
