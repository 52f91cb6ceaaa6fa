"""Pre-warmed pooled kernels (issue 17): a pooled sandbox imports the operator's data stack before
handout, and the user can tell only by the speed. No cell, no execution count, no name in the
namespace, nothing in the transcript; a module that fails or hangs fails the pooled sandbox (the
gateway keeps serving cold starts); names are checked before anything starts.

Speed is measured by the benches, not asserted here: what is asserted is the cause of the speed
(the module is in ``sys.modules`` before the user imports it) and that a cold session lacks it."""

from __future__ import annotations

import asyncio
import logging
import time

import nbformat
import pytest

from sandkernel.errors import ConfigError, KernelStartError
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.kernels.execution.events import SessionObserver
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.pool import WarmPool
from sandkernel.kernels.lifecycle.prewarm import prewarm, validate_modules

from .conftest import RUNTIME_PARAMS, container_ids_of, require_runtime
from .gateway_fixtures import start_gateway, stop_gateway
from .test_pool import docker_containers, pool_size, wait_for_pool

SMALL = {"pids": 128, "cpus": 0.5, "memory_mb": 512}
CSV = "city,sales\\nOslo,3\\nLima,5\\nPune,8\\n"
# What the user's first cell sees of the pre-warm: which modules are loaded, which names are bound.
PROBE = (
    "import sys\n"
    "print(sorted(m for m in ('numpy', 'pandas', 'matplotlib.pyplot') if m in sys.modules),"
    " sorted(n for n in ('np', 'numpy', 'pd', 'pandas', 'plt', 'matplotlib', 'importlib') if n in globals()),"
    " len(In), len(_ih), len(Out), __import__('gc').get_freeze_count() > 0)"
)
# In/_ih hold '' and this cell only; the imports were frozen out of the collector's walks
WARM = "['matplotlib.pyplot', 'numpy', 'pandas'] [] 2 2 0 True\n"
COLD = "[] [] 2 2 0 False\n"  # what a kernel that was not pre-warmed shows


# -- names: checked before any sandbox starts (pure) -----------------------------------------


def test_module_names_are_dotted_identifiers_and_empty_ones_disable():
    assert validate_modules(["numpy", " pandas ", "matplotlib.pyplot", "numpy"]) == (
        "numpy",
        "pandas",
        "matplotlib.pyplot",
    )
    assert validate_modules(["", " "]) == () and validate_modules(()) == ()


@pytest.mark.parametrize(
    "bad", ["os; import shutil", "pandas as pd", "1abc", "a..b", ".pandas", "pandas.", "np\nimport os", "ñumpy", "a-b"]
)
def test_a_name_that_is_not_a_module_name_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="not a module name"):
        validate_modules(["numpy", bad])


def test_a_lone_string_or_a_non_string_is_refused():
    with pytest.raises(ConfigError, match="list of module names"):
        validate_modules("numpy")
    with pytest.raises(ConfigError, match="must be a string"):
        validate_modules(["numpy", 3])  # type: ignore[list-item]


def test_the_pool_refuses_a_bad_name_before_starting_anything():
    with pytest.raises(ConfigError, match="not a module name"):
        WarmPool(1, preload=("numpy", "import os"))
    assert WarmPool(1, preload=("",)).preload == ()  # --pool-preload "" : nothing to import


def test_an_empty_setting_disables_the_preload():
    assert GatewaySettings().pool_preload == ("numpy", "pandas", "matplotlib.pyplot")
    settings = GatewaySettings.from_sources(environ={"SANDKERNEL_POOL_PRELOAD": ""})
    assert validate_modules(settings.pool_preload) == ()
    settings = GatewaySettings.from_sources(flags={"pool_preload": [""]}, environ={})  # --pool-preload ""
    assert validate_modules(settings.pool_preload) == ()
    settings = GatewaySettings.from_sources(environ={"SANDKERNEL_POOL_PRELOAD": "numpy, scipy.stats"})
    assert validate_modules(settings.pool_preload) == ("numpy", "scipy.stats")


# -- through the gateway's pool: only the speed shows ----------------------------------------


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_a_pooled_session_has_the_stack_loaded_and_nothing_else_shows(tmp_path, runtime):
    require_runtime(runtime)
    gateway = await start_gateway(tmp_path, pool_size=1, default_runtime=runtime, max_sessions_total=3)
    try:
        await wait_for_pool(gateway, 1)
        code, warm = await gateway.request("POST", "/api/sessions", {})
        assert code == 201
        execute = f"/api/sessions/{warm['id']}/execute"
        code, first = await gateway.request("POST", execute, {"code": PROBE})
        assert code == 200 and first["status"] == "ok", first
        assert first["execution_count"] == 1, "the pre-warm counted as an execution"
        assert first["outputs"] == [{"output_type": "stream", "name": "stdout", "text": WARM}]
        cell = f"import pandas as pd, io\ndf = pd.read_csv(io.StringIO('{CSV}'))\ndf.shape"
        code, second = await gateway.request("POST", execute, {"code": cell})
        assert code == 200 and second["execution_count"] == 2
        assert second["outputs"][0]["data"]["text/plain"] == "(3, 2)"
        plot = "import matplotlib\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\nmatplotlib.get_backend()"
        code, third = await gateway.request("POST", execute, {"code": plot, "timeout": 120})
        assert code == 200 and third["execution_count"] == 3, third
        kinds = [output.get("output_type") for output in third["outputs"]]
        assert kinds == ["display_data", "execute_result"], third["outputs"]
        assert "image/png" in third["outputs"][0]["data"], "pyplot did not come up with the inline backend"
        assert "matplotlib_inline.backend_inline" in third["outputs"][1]["data"]["text/plain"]

        # The transcript holds the user's three cells and nothing else: no pre-warm cell, no note.
        assert (await gateway.request("DELETE", f"/api/sessions/{warm['id']}"))[0] == 204
        nb = nbformat.read(warm["path"], as_version=4)
        assert nb.metadata["sandkernel"]["warm_pool"] is True
        assert [(c.cell_type, c.get("execution_count")) for c in nb.cells] == [("code", 1), ("code", 2), ("code", 3)]
        assert [c.source for c in nb.cells] == [PROBE, cell, plot]

        # A session of another profile starts cold, as before: nothing of the stack is loaded.
        code, cold = await gateway.request("POST", "/api/sessions", {"profile": "small"})
        assert code == 201
        code, probe = await gateway.request("POST", f"/api/sessions/{cold['id']}/execute", {"code": PROBE})
        assert code == 200 and probe["execution_count"] == 1
        assert probe["outputs"][0]["text"] == COLD, "a cold session was pre-warmed"
    finally:
        await stop_gateway(gateway)
    assert not docker_containers()


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_an_empty_preload_hands_out_a_kernel_that_imported_nothing(tmp_path, runtime):
    require_runtime(runtime)
    gateway = await start_gateway(
        tmp_path, pool_size=1, pool_preload=("",), default_runtime=runtime, max_sessions_total=2
    )
    try:
        await wait_for_pool(gateway, 1)
        code, session = await gateway.request("POST", "/api/sessions", {})
        assert code == 201
        code, probe = await gateway.request("POST", f"/api/sessions/{session['id']}/execute", {"code": PROBE})
        assert code == 200 and probe["execution_count"] == 1
        assert probe["outputs"][0]["text"] == COLD
        assert nbformat.read(session["path"], as_version=4).metadata["sandkernel"]["warm_pool"] is True
    finally:
        await stop_gateway(gateway)
    assert not docker_containers()


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_a_bad_module_name_stops_the_gateway_at_start(tmp_path, runtime):
    require_runtime(runtime)
    with pytest.raises(ConfigError, match="'pandas as pd' is not a module name"):
        await start_gateway(tmp_path, pool_size=1, pool_preload=("numpy", "pandas as pd"), default_runtime=runtime)
    assert not docker_containers()


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_a_missing_module_fails_each_pooled_sandbox_and_cold_starts_go_on(tmp_path, caplog, runtime):
    require_runtime(runtime)
    caplog.set_level(logging.WARNING, logger="sandkernel.kernels.lifecycle.pool")
    gateway = await start_gateway(
        tmp_path,
        pool_size=1,
        pool_preload=("numpy", "no_such_module_h1"),
        default_runtime=runtime,
        max_sessions_total=3,
    )
    try:

        def failures() -> list[str]:
            return [r.getMessage() for r in caplog.records if "failed to start" in r.getMessage()]

        deadline = time.monotonic() + 120
        while len(failures()) < 2:  # the pool retries
            assert time.monotonic() < deadline, "the pool did not retry its failed start"
            await asyncio.sleep(0.2)
        assert "no_such_module_h1 (ModuleNotFoundError: No module named 'no_such_module_h1')" in failures()[0]
        assert "numpy" not in failures()[0].split("preload", 1)[1], (
            "numpy imported fine: only the failing module is named"
        )
        assert await pool_size(gateway) == 0
        code, session = await gateway.request("POST", "/api/sessions", {})  # a cold start
        assert code == 201, session
        code, result = await gateway.request("POST", f"/api/sessions/{session['id']}/execute", {"code": "1 + 1"})
        assert code == 200 and result["outputs"][0]["data"]["text/plain"] == "2"
        assert nbformat.read(session["path"], as_version=4).metadata["sandkernel"]["warm_pool"] is False
    finally:
        await stop_gateway(gateway)
    assert not docker_containers(), "a failed pooled sandbox was left behind"


# -- prewarm itself, on a session ------------------------------------------------------------


class Notes(SessionObserver):
    def __init__(self) -> None:
        self.notes: list[str] = []
        self.executions = 0

    async def note_added(self, text: str) -> None:
        self.notes.append(text)

    async def execution_started(self, request) -> None:
        self.executions += 1


PLANT = (
    "import pathlib\n"
    "pathlib.Path('h1_noisy.py').write_text('import sys\\nprint(\"hello from import\")\\n"
    'print("warned", file=sys.stderr)\\n\')\n'
    "pathlib.Path('h1_broken.py').write_text('raise RuntimeError(\"boom at import\")\\n')\n"
    "pathlib.Path('h1_hangs.py').write_text('import time\\ntime.sleep(600)\\n')\n"
)


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_prewarm_is_silent_names_what_fails_and_gives_up_on_a_hang(runtime):
    """Modules planted in /workspace (the kernel's cwd is on sys.path) stand for an operator's
    modules that print, raise or hang at import."""
    require_runtime(runtime)
    session = await KernelSession.start(overrides={"runtime": runtime, **SMALL})
    try:
        assert (await session.execute(PLANT)).status == "ok"
        seen = Notes()
        session.add_observer(seen)
        await prewarm(session, ["json", "h1_noisy"])
        await asyncio.sleep(1.5)  # the session's drain has long taken what the import printed
        result = await session.execute("import sys\n'h1_noisy' in sys.modules, 'h1_noisy' in globals()")
        assert list(result.outputs) == [
            {
                "output_type": "execute_result",
                "data": {"text/plain": "(True, False)"},
                "metadata": {},
                "execution_count": 2,
            }
        ]
        assert result.execution_count == 2, "the pre-warm counted as an execution"
        assert seen.executions == 1 and seen.notes == [], "the pre-warm was seen by the session's observers"

        with pytest.raises(KernelStartError) as failed:
            await prewarm(session, ["json", "h1_broken", "no_such_module_h1"])
        message = str(failed.value)
        assert (
            "h1_broken (RuntimeError: boom at import)" in message
            and "no_such_module_h1 (ModuleNotFoundError" in message
        )
        assert "json" not in message

        started = time.monotonic()
        with pytest.raises(KernelStartError, match=r"did not finish within 3s \(a module that hangs\?\)"):
            await prewarm(session, ["h1_hangs"], timeout=3)
        assert time.monotonic() - started < 20
        assert session.busy is False, "a pre-warm that gave up still holds the session"
    finally:
        await session.shutdown()
    deadline = time.monotonic() + 30
    while container_ids_of(session.id):
        assert time.monotonic() < deadline, "the session's container outlived its shutdown"
        await asyncio.sleep(0.2)
