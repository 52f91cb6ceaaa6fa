"""The session-layer execute: ordered nbformat outputs, statuses, persistence, serialisation."""

from __future__ import annotations

import asyncio
import base64
import zipfile

import nbformat
import pytest

from sandkernel.kernels.execution.outputs import ExecutionStatus
from sandkernel.kernels.execution.session import KernelSession

from .conftest import RUNTIME_PARAMS, require_runtime

pytestmark = pytest.mark.docker


@pytest.mark.smoke  # the quick tier's check of this door (scripts/test.sh --quick)
async def test_outputs_are_ordered_and_nbformat_shaped(kernel_session):
    result = await kernel_session.execute(
        """import sys
from IPython.display import display, HTML
print('one'); print('two')
print('err', file=sys.stderr)
display(HTML('<b>bold</b>'))
print('three')
40 + 2""",
        timeout=30,
    )
    assert result.status is ExecutionStatus.OK
    kinds = [(o["output_type"], o.get("name")) for o in result.outputs]
    assert kinds[0] == ("stream", "stdout") and result.outputs[0]["text"] == "one\ntwo\n"
    assert ("stream", "stderr") in kinds and ("display_data", None) in kinds
    assert kinds[-1] == ("execute_result", None) and result.outputs[-1]["data"]["text/plain"] == "42"
    assert result.outputs[-1]["execution_count"] == result.execution_count
    assert result.duration > 0 and result.started_at.endswith("+00:00")
    cell = nbformat.v4.new_code_cell("x", outputs=[nbformat.v4.new_output(**o) for o in result.outputs])
    nbformat.validate(nbformat.v4.new_notebook(cells=[cell]))
    assert "one\ntwo\n" in result.text and "42\n" in result.text


async def test_errors_are_data_not_exceptions(kernel_session):
    result = await kernel_session.execute("def f():\n    raise ValueError('bad value')\nf()", timeout=30)
    assert result.status is ExecutionStatus.ERROR
    assert result.error.name == "ValueError" and result.error.value == "bad value"
    assert any("bad value" in line for line in result.error.traceback)
    assert result.outputs[-1]["output_type"] == "error"
    after = await kernel_session.execute("print('still fine')", timeout=30)
    assert after.status is ExecutionStatus.OK and after.execution_count == result.execution_count + 1


async def test_plots_come_back_as_png(kernel_session):
    result = await kernel_session.execute(
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]); plt.title('t'); plt.show()", timeout=60
    )
    images = [o["data"]["image/png"] for o in result.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1
    assert base64.b64decode(images[0])[:8] == b"\x89PNG\r\n\x1a\n"


async def test_state_persists_between_executes(kernel_session):
    await kernel_session.execute(
        "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2, 3]})\nopen('/workspace/note.txt', 'w').write('kept')",
        timeout=60,
    )
    result = await kernel_session.execute(
        "print(df['a'].sum(), pd.__name__, open('/workspace/note.txt').read())", timeout=30
    )
    assert result.text == "6 pandas kept\n"


async def test_concurrent_executes_are_serialised(kernel_session):
    slow = kernel_session.execute("import time; time.sleep(1.0); print('slow done')", timeout=30)
    fast = kernel_session.execute("print('fast done')", timeout=30)
    first, second = await asyncio.gather(slow, fast)
    assert first.text == "slow done\n" and second.text == "fast done\n"
    assert second.execution_count == first.execution_count + 1
    assert second.started_at >= first.started_at


async def test_interrupt_ends_the_running_execution(kernel_session):
    started = asyncio.Event()

    async def on_output(output: dict) -> None:
        if "started" in output.get("text", ""):
            started.set()

    task = asyncio.create_task(
        kernel_session.execute(
            "import time\nprint('started', flush=True)\ntime.sleep(600)", timeout=120, on_output=on_output
        )
    )
    await asyncio.wait_for(started.wait(), 60)  # the cell runs: an interrupt now can only end it
    await kernel_session.interrupt()
    result = await asyncio.wait_for(task, 30)
    assert result.status is ExecutionStatus.INTERRUPTED
    assert result.error.name == "KeyboardInterrupt"
    assert (await kernel_session.execute("print('ok')", timeout=30)).text == "ok\n"


def _make_wheel(directory, name="sk_demo_pkg", version="1.0"):
    """A minimal pure-Python wheel, written by hand so the test needs no build backend."""
    dist = f"{name}-{version}.dist-info"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    files = {
        f"{name}/__init__.py": "ANSWER = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: sandkernel-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for n, text in files.items():
            zf.writestr(n, text)
    return path


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_packages_from_a_wheelhouse_persist_across_restart(tmp_path, runtime):
    require_runtime(runtime)
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    _make_wheel(wheelhouse)
    async with await KernelSession.start(overrides={"runtime": runtime, "wheelhouse": str(wheelhouse)}) as s:
        install = await s.execute("%pip install -q sk_demo_pkg", timeout=120)
        assert install.status is ExecutionStatus.OK, install.text
        assert (await s.execute("import sk_demo_pkg; print(sk_demo_pkg.ANSWER)", timeout=30)).text == "42\n"
        await s.restart()
        again = await s.execute("import sk_demo_pkg; print(sk_demo_pkg.ANSWER)", timeout=30)
        assert again.text == "42\n" and again.state_lost
        # The wheelhouse is read-only to the sandbox.
        denied = await s.execute("open('/wheels/x', 'w')", timeout=30)
        assert denied.status is ExecutionStatus.ERROR and denied.error.name in ("OSError", "PermissionError")
