"""The Python client against a real gateway and real containers: every call, streaming, and one
exception per failure kind. Retries are checked against listeners the test starts on loopback."""

from __future__ import annotations

import asyncio
import time

import pytest

from sandkernel.agent import (
    AsyncSandkernel,
    AuthenticationError,
    BadRequestError,
    CodeError,
    ExecutionTimeoutError,
    GatewayUnreachableError,
    KernelDiedError,
    LimitExceededError,
    NotFoundError,
    OutOfMemoryError,
    RequestTimeoutError,
    Sandkernel,
)

from .gateway_fixtures import ALICE, BOB, gateway_fixture, refusing_port

gateway = gateway_fixture(max_sessions=3)


@pytest.fixture(scope="module")
async def client(gateway):
    async with AsyncSandkernel(gateway.url, ALICE) as sk:
        yield sk


@pytest.fixture(scope="module")
async def client_session(client):
    """A session of the SDK (AsyncSandkernel.session), shared by the module's tests."""
    async with client.session(profile="small", metadata={"test": "client"}) as s:
        yield s


@pytest.mark.smoke  # the quick tier's check of this door (scripts/test.sh --quick)
@pytest.mark.docker
async def test_run_keeps_state_and_returns_ordered_outputs(client_session):
    first = await client_session.run(
        "import sys\nrows = [1, 2, 3]\nprint('out'); print('err', file=sys.stderr)\nsum(rows)"
    )
    assert first.ok and first.status == "ok" and first.execution_count >= 1
    assert [o["output_type"] for o in first.outputs] == ["stream", "stream", "execute_result"]
    assert first.stdout == "out\n" and first.stderr == "err\n"
    assert first.results[0]["text/plain"] == "6" and first.duration > 0
    shell = await client_session.run("!echo shell works in $PWD")
    assert shell.ok and shell.text.strip() == "shell works in /workspace"  # a pty: \r\n
    second = await client_session.run("rows.append(4); len(rows)", tag="toolu_01")
    assert second.text == "4\n" and second.execution_count == first.execution_count + 2
    nb = await client_session.notebook()
    tags = [c["metadata"]["sandkernel"].get("tag") for c in nb["cells"] if c["cell_type"] == "code"]
    assert "toolu_01" in tags


@pytest.mark.docker
async def test_streaming_callbacks_see_outputs_as_they_happen(client_session):
    seen: list[tuple[str, float]] = []
    started = time.monotonic()
    code = "import sys, time\nfor i in range(3):\n    sys.stdout.write(f'{i}\\n'); sys.stdout.flush(); time.sleep(0.4)\n'done'"
    result = await client_session.run(
        code,
        on_stdout=lambda text: seen.append((text, time.monotonic() - started)),
        on_result=lambda bundle: seen.append((bundle["text/plain"], time.monotonic() - started)),
    )
    assert [text for text, _ in seen] == ["0\n", "1\n", "2\n", "'done'"]
    assert seen[0][1] < seen[2][1] - 0.5  # the first line came before the code finished
    assert result.ok and result.stdout == "0\n1\n2\n"


@pytest.mark.docker
async def test_images_errors_and_check(client_session):
    result = await client_session.run("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]); plt.show()")
    assert len(result.images) == 1 and result.images[0].data.startswith(b"\x89PNG")
    failed = await client_session.run("1 / 0")
    assert failed.status == "error" and failed.error.name == "ZeroDivisionError"
    assert "division by zero" in "".join(failed.error.traceback)
    with pytest.raises(CodeError) as err:
        await client_session.run("undefined_name", check=True)
    assert err.value.execution.error.name == "NameError"


@pytest.mark.docker
async def test_files_variables_interrupt_restart(client_session):
    written = await client_session.upload("data/in.csv", "a,b\n1,2\n")
    assert written["size"] == 8
    names = [entry["name"] for entry in await client_session.list_files("data")]
    assert names == ["in.csv"]
    assert await client_session.download("data/in.csv") == b"a,b\n1,2\n"
    await client_session.run("import pandas as pd\nframe = pd.read_csv('data/in.csv')")
    variables = {v["name"]: v for v in await client_session.variables()}
    assert variables["frame"]["type"] == "pandas.DataFrame"
    with pytest.raises(NotFoundError):
        await client_session.download("nope.txt")
    with pytest.raises(BadRequestError):
        await client_session.upload("../escape.txt", "x")
    started = asyncio.Event()
    running = asyncio.create_task(
        client_session.run("import time\nprint('started', flush=True)\ntime.sleep(600)", on_stdout=lambda t: started.set())
    )
    await asyncio.wait_for(started.wait(), 60)  # interrupt the cell once it surely runs
    await client_session.interrupt()
    assert (await running).status == "interrupted"
    await client_session.restart()
    after = await client_session.run("print('frame' in globals())")
    assert after.text == "False\n"
    assert await client_session.download("data/in.csv") == b"a,b\n1,2\n"  # files survive a restart


@pytest.mark.docker
async def test_failure_kinds_raise_their_exception(gateway, client):
    with pytest.raises(AuthenticationError) as err:
        await AsyncSandkernel(gateway.url, "wrong-token").list_sessions()
    assert err.value.status == 401
    with pytest.raises(NotFoundError):
        await client.get_session("no-such-session")
    async with AsyncSandkernel(gateway.url, BOB) as bob:  # another tenant: 404 as for a missing id
        mine = await client.list_sessions()
        with pytest.raises(NotFoundError):
            await bob.get_session(mine[0]["id"])
    with pytest.raises(BadRequestError) as err:
        await client.create_session(limits={"memory_mb": -5})
    assert "memory_mb" in err.value.message
    async with client.session(profile="small", limits={"memory_mb": 256, "execute_timeout": 60}) as s:
        with pytest.raises(LimitExceededError):
            await s.run("x = '" + "a" * (1024 * 1024 + 10) + "'")
        with pytest.raises(ExecutionTimeoutError) as err:
            await s.run("import time; time.sleep(30)", timeout=1, check=True)
        assert err.value.execution.status == "timeout"
        with pytest.raises(OutOfMemoryError):
            await s.run("b = bytearray(2 * 1024**3)", timeout=60, check=True)
        with pytest.raises(KernelDiedError) as err:
            await s.run("import os; os._exit(3)", check=True)
        assert not isinstance(err.value, OutOfMemoryError)
        assert (await s.run("print('alive')")).text == "alive\n"  # the session recovers


@pytest.mark.docker
async def test_session_limit_is_a_limit_error(client):
    async with client.session(profile="small"), client.session(profile="small"):
        with pytest.raises(LimitExceededError) as err:  # max_sessions=3 per token, one is the module's
            await client.create_session(profile="small")
        assert err.value.status == 429


@pytest.mark.docker
async def test_session_context_manager_deletes_and_keeps_notebook(client):
    async with client.session(profile="small") as s:
        await s.run("print('kept')")
        sid = s.id
        path = s.info["path"]
    with pytest.raises(NotFoundError):
        await client.get_session(sid)
    assert sid not in [x["id"] for x in await client.list_sessions()]
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.cells[-1].outputs[0]["text"] == "kept\n"


@pytest.mark.docker
async def test_sync_client_works_from_any_thread(gateway):
    def use_it() -> tuple[str, list[str], str]:
        with Sandkernel(gateway.url, ALICE) as sk, sk.session(profile="small") as s:
            s.run("x = 20")
            streamed: list[str] = []
            result = s.run("print(x + 1); x * 2", on_stdout=streamed.append)
            s.upload("note.txt", b"hi")
            return result.text, streamed, s.download("note.txt").decode()

    text, streamed, note = await asyncio.to_thread(use_it)
    assert text == "21\n40\n" and streamed == ["21\n"] and note == "hi"


class ScriptedHttp:
    """A loopback listener that answers each connection from a script (status per attempt) and
    counts them; for faults a real gateway won't produce on demand (dropped connections, 503s)."""

    def __init__(self, statuses: list[int | None]) -> None:
        self.statuses = statuses  # None: close the connection without answering
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await reader.readuntil(b"\r\n\r\n")
        status = self.statuses[min(self.connections - 1, len(self.statuses) - 1)]
        if status is not None:
            body = b'{"status": "ok"}' if status == 200 else b'{"error": "busy", "message": "try later"}'
            writer.write(
                f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        writer.close()


async def test_idempotent_calls_retry_with_backoff_others_do_not():
    script = ScriptedHttp([None, 503, 200])
    server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with AsyncSandkernel(url, "t", backoff=0.05, max_retries=4) as sk:
            assert (await sk.health())["status"] == "ok"
            assert script.connections == 3  # dropped, 503, then served
            script.connections, script.statuses = 0, [None]
            with pytest.raises(GatewayUnreachableError):
                await sk.create_session()  # starts work: never retried
            assert script.connections == 1
            script.connections = 0
            with pytest.raises(GatewayUnreachableError):
                await sk.list_sessions()
            assert script.connections == 5  # 1 + max_retries
    finally:
        server.close()


async def test_nothing_listening_and_no_answer():
    with refusing_port() as port:
        async with AsyncSandkernel(f"http://127.0.0.1:{port}", "t", backoff=0.01, max_retries=2) as sk:
            with pytest.raises(GatewayUnreachableError) as err:
                await sk.health()
            assert "cannot reach the sandkernel gateway" in str(err.value)

    async def silent(reader, writer):
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with AsyncSandkernel(url, "t", request_timeout=0.5, max_retries=0) as sk:
            with pytest.raises(RequestTimeoutError):
                await sk.list_sessions()
    finally:
        server.close()
