"""LangChain's standard sandbox tests (``langchain_tests.integration_tests.SandboxIntegrationTests``,
pinned in pyproject.toml), the suite every deepagents provider runs, against ``SandkernelSandbox``
over a real gateway and real containers, under runc and gVisor (issue 31).

The suite works in /tmp/test_sandbox_ops/<test>/ (absolute paths outside /workspace, created by
the uploads themselves), moves files of 10 MiB, pages 500 KiB reads through ``execute`` and runs
five 500 KiB commands at once. Its sync tests call the sandbox on pytest's own thread, so the
gateway runs on an event loop of its own, in a thread, and the sandbox is given a blocking
:class:`sandkernel.agent.Session`.

Seven tests fail for every deepagents sandbox with this suite and deepagents 0.7 (Daytona's,
Modal's, E2B's alike): their expectations predate the protocol's current contract. Each is marked
``xfail(strict=True)`` with why, so a change on either side shows up here.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from deepagents.backends.protocol import SandboxBackendProtocol
from langchain_tests.integration_tests import SandboxIntegrationTests

from sandkernel.agent import Sandkernel
from sandkernel.integrations.deepagents import SandkernelSandbox

from .conftest import RUNTIME_PARAMS, require_runtime
from .gateway_fixtures import ALICE, Gateway, start_gateway, stop_gateway

pytestmark = pytest.mark.docker

# deepagents 0.7's BackendProtocol.glob returns absolute paths of regular files only (its
# docstring; deepagents PR #5026); langchain-tests 1.1.9 still expects names relative to the
# searched directory, and directories. The fix of the tests is langchain PR #40283.
GLOB_CONTRACT = (
    "deepagents 0.7's glob returns absolute paths of files only; langchain-tests 1.1.9 expects relative ones"
)
# deepagents 0.7's write overwrites an existing file (its docstring: "creating it or overwriting it").
WRITE_CONTRACT = "deepagents 0.7's write overwrites an existing file; langchain-tests 1.1.9 expects a refusal"


class ThreadedGateway:
    """A test gateway (tests/gateway_fixtures.py) on an event loop of its own thread: the suite's
    sync tests block pytest's thread, where the usual gateway fixture's loop runs."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="standard-suite-gateway", daemon=True)
        self.thread.start()
        self.gateway: Gateway | None = None

    def start(self, tmp_path: Path, runtime: str) -> Gateway:
        started = asyncio.run_coroutine_threadsafe(start_gateway(tmp_path, default_runtime=runtime), self.loop)
        self.gateway = started.result(180)
        return self.gateway

    def stop(self) -> None:
        try:
            if self.gateway is not None:
                asyncio.run_coroutine_threadsafe(stop_gateway(self.gateway), self.loop).result(180)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()


class TestSandkernelSandboxStandard(SandboxIntegrationTests):
    @pytest.fixture(scope="class", params=RUNTIME_PARAMS)
    def sandbox(
        self, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[SandboxBackendProtocol]:
        require_runtime(request.param)
        gateway = ThreadedGateway()
        try:
            url = gateway.start(tmp_path_factory.mktemp(f"standard-{request.param}"), request.param).url
            with Sandkernel(url, ALICE) as client, client.session() as session:
                yield SandkernelSandbox(session)
        finally:
            gateway.stop()

    @pytest.mark.xfail(reason=WRITE_CONTRACT, strict=True)
    def test_write_existing_file_fails(self, sandbox_backend: SandboxBackendProtocol, sandbox_test_root: str) -> None:
        super().test_write_existing_file_fails(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_CONTRACT, strict=True)
    def test_glob(self, sandbox_backend: SandboxBackendProtocol, sandbox_test_root: str) -> None:
        super().test_glob(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_CONTRACT, strict=True)
    def test_glob_basic_pattern(self, sandbox_backend: SandboxBackendProtocol, sandbox_test_root: str) -> None:
        super().test_glob_basic_pattern(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_CONTRACT, strict=True)
    def test_glob_with_directories(self, sandbox_backend: SandboxBackendProtocol, sandbox_test_root: str) -> None:
        super().test_glob_with_directories(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_CONTRACT, strict=True)
    def test_glob_hidden_files_explicitly(
        self, sandbox_backend: SandboxBackendProtocol, sandbox_test_root: str
    ) -> None:
        super().test_glob_hidden_files_explicitly(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_CONTRACT, strict=True)
    def test_glob_with_character_class(self, sandbox_backend: SandboxBackendProtocol, sandbox_test_root: str) -> None:
        super().test_glob_with_character_class(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_CONTRACT, strict=True)
    def test_glob_with_question_mark(self, sandbox_backend: SandboxBackendProtocol, sandbox_test_root: str) -> None:
        super().test_glob_with_question_mark(sandbox_backend, sandbox_test_root)
