"""What the kernel image ships: widget support, and the variables listing as an image-owned module.

The listing runs as ``__import__('sys').modules['sandkernel_variables'].listing(get_ipython())``
(a silent ``user_expressions`` request). The module lives in /opt/sandkernel (root-owned, read-only to the
sandbox user) and start_kernel.py imports it before user code, so a file of the same name planted
in the workspace (the tenant's, and on sys.path) cannot answer in its place, even when the code
puts the workspace first on sys.path as notebooks often do (``sys.path.insert(0, '.')``), and
even after a restart.
"""

from __future__ import annotations

import pytest

from sandkernel.kernels.execution import variables as variables_module

pytestmark = pytest.mark.docker

# The expression the session sends (kernels/execution/variables.py VARIABLES_EXPRESSION once it
# is switched; set here so the test proves the module path either way). It looks the module up in
# sys.modules, where start_kernel.py bound it: no import by name, so sys.path is never searched.
MODULE_EXPRESSION = "__import__('sys').modules['sandkernel_variables'].listing(get_ipython())"

PLANTED = """
def listing(shell):
    return '[{"name": "planted", "type": "str", "size": 0, "shape": null}]'
"""


# The same call by name: safe only because start_kernel.py bound the module before user code
# (without that, the planted file below answers it: checked with an image lacking the import).
IMPORT_EXPRESSION = "__import__('sandkernel_variables').listing(get_ipython())"


@pytest.fixture(params=[MODULE_EXPRESSION, IMPORT_EXPRESSION], ids=["sys.modules", "__import__"])
def module_expression(request, monkeypatch):
    monkeypatch.setattr(variables_module, "VARIABLES_EXPRESSION", request.param)


async def test_widgets_and_tqdm_notebook_work_and_keep_the_cells_output(kernel_session):
    """ipywidgets and tqdm.notebook import (they did not: ModuleNotFoundError), and the burst of
    comm messages a progress bar sends does not push the cell's own print out of the kernel's
    iopub send queue (at 16 messages it did, in about one run in eight)."""
    lost = []
    for attempt in range(20):
        result = await kernel_session.execute(
            "import ipywidgets, tqdm\nfrom tqdm.notebook import tqdm as bar\n"
            "print(sum(bar(range(3))), ipywidgets.IntSlider(value=2).value)",
            timeout=60,
        )
        assert result.status.value == "ok", result.outputs
        if not result.text.endswith("\n3 2\n"):
            lost.append((attempt, result.text))
    assert lost == []


async def test_variables_listing_comes_from_the_image_module(kernel_session, module_expression):
    await kernel_session.execute(
        "import numpy as np, pandas as pd\n"
        "grid = np.zeros((3, 4))\nframe = pd.DataFrame({'a': [1, 2]})\nname = 'abc'\n_hidden = 1\n"
        "def helper():\n    pass",
        timeout=60,
    )
    found = {v["name"]: v for v in await kernel_session.variables()}
    assert found["grid"] == {"name": "grid", "type": "numpy.ndarray", "size": 96, "shape": [3, 4]}
    assert found["frame"]["type"] == "pandas.DataFrame" and found["frame"]["shape"] == [2, 1]
    assert found["name"] == {"name": "name", "type": "str", "size": 3, "shape": None}
    assert "_hidden" not in found and "helper" not in found and "np" not in found
    where = await kernel_session.execute(
        "import os, sandkernel_variables\nprint(sandkernel_variables.__file__, os.access(sandkernel_variables.__file__, os.W_OK))",
        timeout=30,
    )
    assert where.text == "/opt/sandkernel/sandkernel_variables.py False\n"


async def test_a_planted_module_never_answers_the_listing(kernel_session, module_expression):
    """Files named like the module in the workspace and its site-packages, with the workspace
    put first on sys.path, do not take over; nor after a restart (the image module is bound
    again before user code)."""
    planted = await kernel_session.execute(
        "import os, sys\n"
        f"open('/workspace/sandkernel_variables.py', 'w').write({PLANTED!r})\n"
        "site = '/workspace/.local/lib/python3.11/site-packages'\nos.makedirs(site, exist_ok=True)\n"
        f"open(site + '/sandkernel_variables.py', 'w').write({PLANTED!r})\n"
        "sys.path.insert(0, '/workspace')\nsys.path.insert(0, '.')\nmarker = 1",
        timeout=30,
    )
    assert planted.status.value == "ok", planted.outputs
    try:
        names = [v["name"] for v in await kernel_session.variables()]
        assert "planted" not in names and "marker" in names, names
        await kernel_session.restart()
        await kernel_session.execute("import sys\nsys.path.insert(0, '/workspace')\nafter_restart = 2", timeout=30)
        names = [v["name"] for v in await kernel_session.variables()]
        assert "planted" not in names and "after_restart" in names, names
    finally:
        await kernel_session.execute(
            "import os\nfor p in ('/workspace/sandkernel_variables.py', "
            "'/workspace/.local/lib/python3.11/site-packages/sandkernel_variables.py'):\n"
            "    os.path.exists(p) and os.remove(p)",
            timeout=30,
        )


async def test_no_history_database(kernel_session):
    """IPython's history database is off (the transcript is the record): no thread saving it, no
    file under /tmp/.ipython. Its saving thread printed its own failures ("The history saving
    thread hit an unexpected error", after a cell had used up the process's fds) into cell output."""
    for _ in range(2):  # the file would exist once a cell ran
        result = await kernel_session.execute(
            "import os\nprint(get_ipython().history_manager.enabled,"
            " os.path.exists('/tmp/.ipython/profile_default/history.sqlite'))",
            timeout=60,
        )
        assert result.status.value == "ok" and result.text == "False False\n", result.outputs
