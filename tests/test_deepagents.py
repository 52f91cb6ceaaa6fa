"""The deepagents door: ``SandkernelSandbox`` against real sessions (a real gateway, real containers,
under runc and gVisor), every protocol method with sync and async sessions, and the real
``deepagents.create_deep_agent`` with the real ``ChatAnthropic`` pointed at the offline scripted
Messages API, on the sales CSV task; its transcript replays the same."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import nbformat
import pytest
from deepagents import create_deep_agent
from deepagents.backends.protocol import FileDownloadResponse, FileUploadResponse
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import ToolMessage

from sandkernel.agent import AsyncSandkernel, Sandkernel
from sandkernel.agent.loop import DEFAULT_MODEL
from sandkernel.agent.offline_api import (
    ScriptedMessagesServer,
    ScriptedTurn,
    call,
    result_contains,
    result_has_image,
    result_is_error,
    say,
)
from sandkernel.agent.scenarios import SALES_ROWS, SALES_TASK, make_sales_files, sales_by_quarter
from sandkernel.integrations.deepagents import OUTPUT_LIMIT, SandkernelSandbox, run_python_tool, sandbox_path
from sandkernel.notebooks.replay import replay_notebook

from .conftest import DOOR_RUNTIME_PARAMS, RUNTIME_PARAMS
from .gateway_fixtures import ALICE, gateway_fixture

FLAVORS = ["sync", "async"]
BINARY = bytes(range(256)) * 64 + b"\x00\r\n\x89PNG\r\n\x1a\n"  # every byte value, CRLFs, NULs


gateway = gateway_fixture(runtimes=DOOR_RUNTIME_PARAMS)  # the smoke test: both


@pytest.fixture(scope="module")
async def sessions(gateway):
    """One blocking Session and one AsyncSession on the gateway, shared by the module's tests."""
    blocking = Sandkernel(gateway.url, ALICE)
    async with AsyncSandkernel(gateway.url, ALICE) as client:
        async_session = await client.create_session()
        sync_session = await asyncio.to_thread(blocking.create_session)
        yield {"sync": sync_session, "async": async_session}
        await asyncio.to_thread(sync_session.delete)
        await async_session.delete()
    await asyncio.to_thread(blocking.close)


class Driver:
    """Calls a sandbox method the way its flavour is used: ``aNAME`` awaited for an AsyncSession,
    ``NAME`` in a worker thread for a blocking Session (the test's loop runs the gateway)."""

    def __init__(self, sandbox: SandkernelSandbox, flavor: str) -> None:
        self.sandbox, self.flavor = sandbox, flavor

    async def __call__(self, name: str, *args, **kwargs):
        if self.flavor == "async":
            return await getattr(self.sandbox, f"a{name}")(*args, **kwargs)
        return await asyncio.to_thread(getattr(self.sandbox, name), *args, **kwargs)


@pytest.fixture(params=FLAVORS)
def use(request, sessions):
    return Driver(SandkernelSandbox(sessions[request.param]), request.param)


# -- execute ---------------------------------------------------------------------------------


@pytest.mark.smoke  # the quick tier's check of this door (scripts/test.sh --quick)
@pytest.mark.parametrize("gateway", RUNTIME_PARAMS, indirect=True)
async def test_execute_runs_a_shell_command_with_its_exit_code(use, sessions):
    sandbox = use.sandbox
    assert sandbox.id == sessions[use.flavor].id
    result = await use("execute", "mkdir -p 'dir with spaces' && cd 'dir with spaces' && pwd; echo oops >&2; exit 3")
    assert result.exit_code == 3 and not result.truncated
    assert result.output == "/workspace/dir with spaces\noops\n"
    piped = await use("execute", "printf 'b\\na\\nc\\n' | sort | tr '\\n' ,")
    assert (piped.output, piped.exit_code) == ("a,b,c,", 0)


async def test_a_command_past_its_timeout_is_stopped_and_the_session_goes_on(use):
    began = time.monotonic()
    result = await use("execute", "echo before; sleep 60 & sleep 60; echo never", timeout=2)
    took = time.monotonic() - began
    assert result.exit_code == 124  # as timeout(1) reports it
    assert result.output.startswith("before\n") and "never" not in result.output
    assert "stopped at its timeout of 2 s" in result.output
    assert took < 20, f"the 2 s timeout took {took:.1f} s"
    # The whole process group went (the background sleep too), and the next command runs.
    after = await use("execute", "ps -eo args | grep -c '^sleep 60' || true")
    assert (after.output.strip(), after.exit_code) == ("0", 0)


# -- files -----------------------------------------------------------------------------------


async def test_files_go_up_and_come_back_byte_exact(use):
    base = f"/workspace/up {use.flavor}/sub dir"
    files = [
        (f"{base}/data file.bin", BINARY),
        (f"{base}/notes.txt", "naïve café €\n".encode()),
        (f"/tmp/up {use.flavor}/new/dir/x.txt", b"anywhere"),  # any place the sandbox's user may write
        (f"{base}/empty", b""),
    ]
    uploaded = await use("upload_files", files)
    assert uploaded == [FileUploadResponse(path=path, error=None) for path, _ in files]
    downloaded = await use("download_files", [path for path, _ in files])
    assert downloaded == [FileDownloadResponse(path=path, content=data, error=None) for path, data in files]
    # The files are where the shell sees them.
    listed = await use(
        "execute",
        f"cmp '{base}/data file.bin' - < '{base}/data file.bin' && wc -c < '/tmp/up {use.flavor}/new/dir/x.txt'",
    )
    assert (listed.output.strip(), listed.exit_code) == ("8", 0)


async def test_file_errors_are_the_protocols_values_in_order(use):
    secret = f"/workspace/secret {use.flavor}"
    await use("execute", f"mkdir -p 'a dir {use.flavor}' && echo s > '{secret}' && chmod 000 '{secret}'")
    paths = [
        f"/workspace/missing {use.flavor}.txt",
        f"/workspace/a dir {use.flavor}",
        secret,
        "../outside.txt",
        "relative.txt",
        "/workspace",
        "/tmp/nothing here.txt",
    ]
    downloaded = await use("download_files", paths)
    assert [(r.path, r.content, r.error) for r in downloaded] == [
        (paths[0], None, "file_not_found"),
        (paths[1], None, "is_directory"),
        (paths[2], None, "permission_denied"),
        (paths[3], None, "invalid_path"),
        (paths[4], None, "invalid_path"),
        (paths[5], None, "is_directory"),
        (paths[6], None, "file_not_found"),
    ]
    # A batch succeeds per file: the good ones are written, the others refused, in order.
    uploaded = await use(
        "upload_files",
        [
            ("/etc/evil", b"x"),  # the root file system is read-only
            (f"/workspace/a dir {use.flavor}", b"x"),
            ("relative/x.txt", b"x"),
            (f"/tmp/ok {use.flavor}/deeper/ok", b"ok"),
        ],
    )
    assert [r.error for r in uploaded] == ["permission_denied", "is_directory", "invalid_path", None]
    assert (await use("download_files", [f"/tmp/ok {use.flavor}/deeper/ok"]))[0].content == b"ok"


def test_only_absolute_paths_go_through():
    assert sandbox_path("/workspace/a b/c.txt") == "/workspace/a b/c.txt"
    assert sandbox_path("/tmp/x/../y") == "/tmp/x/../y"  # resolved in the sandbox, as its user
    for refused in ("a b/c.txt", "..", "", "a\x00b", "/tmp/a\x00b", None):
        assert sandbox_path(refused) is None, refused


# -- the file tools deepagents builds on execute ------------------------------------------------


async def test_the_file_tools_work_in_the_sandbox_image(use):
    root = f"/workspace/tools {use.flavor}"
    path = f"{root}/src/hello world.py"
    written = await use("write", path, "print('hello')\n# TODO: more\nprint('bye')\n")
    assert written.error is None and written.path == path
    read = await use("read", path)
    assert read.error is None and read.file_data["content"] == "print('hello')\n# TODO: more\nprint('bye')"
    page = await use("read", path, offset=1, limit=1)
    assert page.file_data["content"] == "# TODO: more" and (page.start_line, page.end_line) == (2, 2)
    edited = await use("edit", path, "# TODO: more", "print('more')")
    assert edited.error is None and edited.occurrences == 1
    not_unique = await use("edit", path, "print", "log")
    assert not_unique.error and "appears multiple times" in not_unique.error
    assert (await use("execute", f"python3 '{path}'")).output == "hello\nmore\nbye\n"
    await use("write", f"{root}/notes.md", "hello from notes\n")
    listing = await use("ls", root)
    assert sorted((e["path"], e["is_dir"]) for e in listing.entries) == [
        (f"{root}/notes.md", False),
        (f"{root}/src", True),
    ]
    grep = await use("grep", "hello", root)
    assert sorted((m["path"], m["line"], m["text"]) for m in grep.matches) == [
        (f"{root}/notes.md", 1, "hello from notes"),
        (path, 1, "print('hello')"),
    ]
    only_py = await use("grep", "hello", root, "*.py")
    assert [m["path"] for m in only_py.matches] == [path]
    globbed = await use("glob", "**/*.py", root)
    assert [m["path"] for m in globbed.matches] == [path]
    missing = await use("read", f"{root}/nope.txt")
    assert missing.error and "nope.txt" in missing.error
    assert (await use("ls", f"{root}/nope")).error
    deleted = await use("delete", f"{root}/notes.md")
    assert deleted.error is None
    assert [e["path"] for e in (await use("ls", root)).entries] == [f"{root}/src"]


async def test_an_edit_too_large_to_send_inline_goes_through_tmp(use):
    """deepagents sends old and new text over 50 KB as /tmp files, uploaded like any other file."""
    path = f"/workspace/large edit {use.flavor}.txt"
    old, new = "a" * 40_000, "b" * 40_000
    await use("upload_files", [(path, f"start\n{old}\nend\n".encode())])
    edited = await use("edit", path, old, new)
    assert edited.error is None and edited.occurrences == 1
    [content] = await use("download_files", [path])
    assert content.content == f"start\n{new}\nend\n".encode()
    leftovers = await use("execute", "find /tmp -maxdepth 1 -name '.deepagents_edit_*' | wc -l")  # not ls: gVisor
    assert leftovers.output.strip() == "0"  # deepagents' own command removed its temp files
    big = await use("upload_files", [(f"/tmp/big {use.flavor}", b"x" * 3_000_000)])
    assert big == [FileUploadResponse(path=f"/tmp/big {use.flavor}", error=None)]
    assert (await use("execute", f"wc -c < '/tmp/big {use.flavor}'")).output.strip() == "3000000"


async def test_pages_and_matches_larger_than_the_shells_output_still_read_right(use):
    """A command brings back OUTPUT_LIMIT (2 MiB) at most; read and grep must not hand a cut
    document on. Control characters travel as six-byte JSON escapes, so a page of them outgrows it."""
    lines = ["\x01" * 199 for _ in range(2000)]  # 400 KB of text, 2.4 MB as the read's JSON
    path = f"/workspace/big {use.flavor}/wide.txt"
    wide = [f"{i:05d} " + "x" * 94 for i in range(25_000)]  # 2.5 MB: more matches than one command brings
    await use(
        "upload_files",
        [
            (path, "\n".join(lines).encode()),
            (f"{path}.one", b"\x01" * 400_000),
            (f"{path}.grep", "\n".join(wide).encode()),
        ],
    )
    page = await use("read", path)  # 2000 lines asked: too large as JSON, so a smaller page comes back whole
    assert page.error is None and page.start_line == 1 and page.end_line < 2000
    assert page.file_data["content"] == "\n".join(lines[: page.end_line])
    following = await use("read", path, offset=page.next_offset)
    assert following.file_data["content"].split("\n")[0] == lines[page.end_line]
    too_long = await use("read", f"{path}.one")
    assert too_long.error and f"{OUTPUT_LIMIT // 1024} KiB" in too_long.error and "execute" in too_long.error
    grep = await use("grep", "xxxx", f"/workspace/big {use.flavor}", "*.grep")
    assert grep.truncated and 0 < len(grep.matches) < 25_000


async def test_blocking_calls_on_an_async_session_from_its_own_loop_say_what_to_do(sessions):
    sandbox = SandkernelSandbox(sessions["async"])
    with pytest.raises(RuntimeError, match="ainvoke"):
        sandbox.execute("true")
    with pytest.raises(TypeError, match="Session or AsyncSession"):
        SandkernelSandbox("not a session")


def test_without_the_extra_the_import_error_says_what_to_install():
    code = (
        "import sys; sys.modules['deepagents'] = None\n"
        "try:\n    import sandkernel.integrations.deepagents\n"
        "except ImportError as err:\n    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'sandkernel[deepagents]'" in out


# -- run_python --------------------------------------------------------------------------------


async def test_run_python_keeps_state_and_returns_errors_and_images(use, sessions):
    # Both forms: the sandbox's method, and the function over a bare session.
    tool = use.sandbox.run_python_tool() if use.flavor == "async" else run_python_tool(sessions["sync"])
    assert tool.name == "run_python" and "persistent" in tool.description

    async def invoke(code, call_id):
        tool_call = {"type": "tool_call", "name": "run_python", "args": {"code": code}, "id": call_id}
        if use.flavor == "async":
            return await tool.ainvoke(tool_call)
        return await asyncio.to_thread(tool.invoke, tool_call)

    first = await invoke("x = 41\nprint('set')", "c1")
    assert isinstance(first, ToolMessage) and first.status == "success" and first.content[0]["text"] == "set"
    second = await invoke("x + 1", "c2")
    assert second.content[0]["text"] == "42"
    failed = await invoke("def f():\n    return 1 / 0\nf()", "c3")
    assert failed.status == "error"
    text = failed.content[0]["text"]
    assert "ZeroDivisionError" in text and "return 1 / 0" in text  # the traceback, not only the name
    plotted = await invoke("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()", "c4")
    image = next(block for block in plotted.content if block["type"] == "image")
    assert image["source"]["media_type"] == "image/png" and len(image["source"]["data"]) > 1000
    # Every call is a transcript cell from the deepagents door.
    session = sessions[use.flavor]
    notebook = await asyncio.to_thread(session.notebook) if use.flavor == "sync" else await session.notebook()
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"][-4:]
    assert cells[0]["source"] == "x = 41\nprint('set')"
    assert {c["metadata"]["sandkernel"].get("source") for c in cells} == {"deepagents"}


# -- end to end: create_deep_agent on the sales task ------------------------------------------

READ_LIMIT = 5
REPORT = "/workspace/out/report.md"


def deep_agent_sales_turns() -> list[ScriptedTurn]:
    """The sales task as a deepagents model would work it: a look with the shell, a read_file,
    the numbers and the chart with run_python, a report written, edited, grepped and listed."""
    answer = sales_by_quarter()
    best = max(answer, key=lambda q: answer[q]["total"])
    table = "\n".join(f"| {q} | {v['total']:.2f} | {v['avg_order_value']:.2f} |" for q, v in answer.items())
    return [
        ScriptedTurn(
            [say("Let me look at the file first."), call("execute", command="head -3 sales.csv; wc -l < sales.csv")]
        ),
        ScriptedTurn(
            [call("read_file", file_path="/workspace/sales.csv", offset=0, limit=READ_LIMIT)],
            expect=[
                result_contains("order_id,date,region,amount"),
                result_contains(str(SALES_ROWS + 1)),
                result_contains("exit code 0"),
            ],
        ),
        ScriptedTurn(
            [
                say("Now the per-quarter numbers, in the kernel."),
                call(
                    "run_python",
                    code='import pandas as pd\nsales = pd.read_csv("sales.csv", parse_dates=["date"])\n'
                    'sales["quarter"] = sales["date"].dt.to_period("Q").astype(str)\n'
                    'by_quarter = sales.groupby("quarter")["amount"].agg(total="sum", avg_order_value="mean").round(2)\n'
                    "print(len(sales))\nprint(by_quarter.to_string())",
                ),
            ],
            expect=[result_is_error(False), result_contains("order_id,date,region,amount")],
        ),
        ScriptedTurn(
            [
                call(
                    "run_python",
                    code="import matplotlib.pyplot as plt\n"
                    "fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))\n"
                    'by_quarter["total"].plot(ax=left, marker="o", title="Total sales per quarter")\n'
                    'by_quarter["avg_order_value"].plot(kind="bar", ax=right, title="Average order value")\n'
                    'fig.tight_layout()\nfig.savefig("report.png", dpi=100)\nplt.show()',
                )
            ],
            expect=[result_is_error(False), result_contains(str(SALES_ROWS)), result_contains("2025Q4")],
        ),
        ScriptedTurn(
            [
                call(
                    "write_file",
                    file_path=REPORT,
                    content=f"# Sales by quarter\n\n| quarter | total | average order |\n|---|---|---|\n{table}\n\n"
                    "Best quarter: TBD\n",
                )
            ],
            expect=[result_has_image],
        ),
        ScriptedTurn(
            [call("edit_file", file_path=REPORT, old_string="Best quarter: TBD", new_string=f"Best quarter: {best}")],
            expect=[result_is_error(False), result_contains(REPORT)],
        ),
        ScriptedTurn(
            [call("grep", pattern="Best quarter", path="/workspace/out", output_mode="content")],
            expect=[result_is_error(False), result_contains("Successfully replaced 1 instance")],
        ),
        ScriptedTurn(
            [call("ls", path="/workspace/out")],
            expect=[result_contains(f"Best quarter: {best}")],
        ),
        ScriptedTurn(
            [call("glob", pattern="*.png", path="/workspace")],
            expect=[result_contains(REPORT)],
        ),
        ScriptedTurn(
            [say(f"The best quarter was {best}; the table is in {REPORT} and the charts in report.png.")],
            expect=[result_contains("/workspace/report.png")],
        ),
    ]


async def test_create_deep_agent_works_the_sales_task_and_its_transcript_replays(gateway, tmp_path):
    (csv_path,) = make_sales_files(tmp_path)
    async with AsyncSandkernel(gateway.url, ALICE) as client, client.session() as session:
        await session.upload("sales.csv", csv_path.read_bytes())
        sandbox = SandkernelSandbox(session)
        async with ScriptedMessagesServer(deep_agent_sales_turns()) as server:
            model = ChatAnthropic(model=DEFAULT_MODEL, base_url=server.url, api_key="test", max_retries=0)
            agent = create_deep_agent(model=model, backend=sandbox, tools=[sandbox.run_python_tool()])
            state = await agent.ainvoke({"messages": [{"role": "user", "content": SALES_TASK}]})
        answer = sales_by_quarter()
        best = max(answer, key=lambda q: answer[q]["total"])
        assert len(server.requests) == len(deep_agent_sales_turns())  # the whole script, every expectation met
        assert state["messages"][-1].content.endswith("charts in report.png.")
        tools_used = [m.name for m in state["messages"] if isinstance(m, ToolMessage)]
        assert tools_used == [
            "execute",
            "read_file",
            "run_python",
            "run_python",
            "write_file",
            "edit_file",
            "grep",
            "ls",
            "glob",
        ]
        report = (await session.download("out/report.md")).decode()
        assert f"Best quarter: {best}" in report and f"{answer[best]['total']:.2f}" in report
        assert (await session.download("report.png")).startswith(b"\x89PNG")
        notebook = await session.notebook()
    path = tmp_path / "deepagents-sales.ipynb"
    nbformat.write(nbformat.from_dict(notebook), path)
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    assert cells and {c.metadata["sandkernel"].get("source") for c in cells} == {"deepagents"}
    assert cells[0].source.startswith("# $ head -3 sales.csv")
    # The files the agent wrote through upload_files are inputs of the transcript, so a replay has them.
    inputs = [entry["path"] for entry in notebook["metadata"]["sandkernel"]["inputs"]]
    assert inputs[0] == "sales.csv" and "out/report.md" in inputs
    _, verdicts = await asyncio.to_thread(replay_notebook, path)
    assert [v.verdict for v in verdicts] == ["same"] * len(cells), [(v.index, v.verdict, v.diff) for v in verdicts]


# -- end to end: a deep agent working in /tmp and /workspace, a large edit, a PNG read back -----

NOTES = "/tmp/agent work/notes.txt"
BIG = "/workspace/big.txt"
BIG_TEXT = "".join(f"line {i:05d} " + "a" * 50 + "\n" for i in range(2000))  # 122 KB
OLD_BLOCK = BIG_TEXT[100 * 61 : 600 * 61]  # 30 KB each way: over the 50 KB deepagents edits inline
NEW_BLOCK = OLD_BLOCK.replace("a", "b")
CHART = "/workspace/chart.png"


def deep_agent_files_turns() -> list[ScriptedTurn]:
    return [
        ScriptedTurn([say("Notes first, in scratch space."), call("write_file", file_path=NOTES, content="scratch\n")]),
        ScriptedTurn(
            [call("write_file", file_path=BIG, content=BIG_TEXT)],
            expect=[result_is_error(False), result_contains("notes.txt")],
        ),
        ScriptedTurn(
            [call("edit_file", file_path=BIG, old_string=OLD_BLOCK, new_string=NEW_BLOCK)],
            expect=[result_is_error(False), result_contains("big.txt")],
        ),
        ScriptedTurn(
            [
                call(
                    "run_python",
                    code="import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
                    "fig, ax = plt.subplots(figsize=(3, 2))\nax.plot([1, 3, 2])\n"
                    f"fig.savefig({CHART!r}, dpi=50)\nplt.close(fig)\nprint('saved')",
                )
            ],
            expect=[result_is_error(False), result_contains("Successfully replaced 1 instance")],
        ),
        ScriptedTurn([call("read_file", file_path=CHART)], expect=[result_contains("saved")]),
        ScriptedTurn([call("read_file", file_path=NOTES)], expect=[result_has_image]),
        ScriptedTurn([say("The chart and the notes are in place.")], expect=[result_contains("scratch")]),
    ]


async def test_a_deep_agent_works_in_tmp_and_workspace_edits_a_large_file_reads_a_png_and_replays(gateway, tmp_path):
    async with AsyncSandkernel(gateway.url, ALICE) as client, client.session() as session:
        sandbox = SandkernelSandbox(session)
        async with ScriptedMessagesServer(deep_agent_files_turns()) as server:
            model = ChatAnthropic(model=DEFAULT_MODEL, base_url=server.url, api_key="test", max_retries=0)
            agent = create_deep_agent(model=model, backend=sandbox, tools=[sandbox.run_python_tool()])
            state = await agent.ainvoke({"messages": [{"role": "user", "content": "Make the chart and keep notes."}]})
        assert len(server.requests) == len(deep_agent_files_turns())  # every expectation met
        assert state["messages"][-1].content == "The chart and the notes are in place."
        assert await session.download(NOTES) == b"scratch\n"
        assert await session.download(BIG) == BIG_TEXT.replace(OLD_BLOCK, NEW_BLOCK).encode()
        assert (await session.download(CHART)).startswith(b"\x89PNG")
        notebook = await session.notebook()
    inputs = [entry["path"] for entry in notebook["metadata"]["sandkernel"]["inputs"]]
    assert NOTES in inputs and "big.txt" in inputs  # /workspace files by their workspace name
    assert any(path.startswith("/tmp/.deepagents_edit_") for path in inputs)  # the large edit's texts
    path = tmp_path / "deepagents-files.ipynb"
    nbformat.write(nbformat.from_dict(notebook), path)
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    _, verdicts = await asyncio.to_thread(replay_notebook, path)
    assert [v.verdict for v in verdicts] == ["same"] * len(cells), [(v.index, v.verdict, v.diff) for v in verdicts]
