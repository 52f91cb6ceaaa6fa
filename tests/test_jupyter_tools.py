"""Standard Jupyter tools start sandboxed kernels by name: jupyter_client and nbclient."""

from __future__ import annotations

import asyncio
import os

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

from sandkernel.kernels.sandbox.kernelspec import install_kernelspecs

from .conftest import container_ids_of, require_runtime

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def kernelspec_prefix(tmp_path_factory):
    """Install the kernelspecs into a private prefix and point Jupyter at it."""
    prefix = tmp_path_factory.mktemp("prefix")
    paths = install_kernelspecs(prefix=str(prefix))
    assert {os.path.basename(p) for p in paths} == {"sandkernel-python", "sandkernel-python-gvisor"}
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
    yield prefix
    if old is None:
        del os.environ["JUPYTER_PATH"]
    else:
        os.environ["JUPYTER_PATH"] = old


def _run_with_jupyter_client(kernel_name: str) -> tuple[str, str, str]:
    km, kc = start_new_kernel(kernel_name=kernel_name, startup_timeout=90)
    try:
        texts: list[str] = []
        reply = kc.execute_interactive(
            "import os, socket; print(os.getuid(), [n for _, n in socket.if_nameindex()])",
            timeout=60,
            output_hook=lambda msg: texts.append(msg["content"].get("text", "")),
        )
        session = km.provisioner.session_id
        assert container_ids_of(session)
        return reply["content"]["status"], "".join(texts), session
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.parametrize(
    ("kernel_name", "runtime"),
    [("sandkernel-python", "runc"), pytest.param("sandkernel-python-gvisor", "runsc", marks=pytest.mark.runsc)],
)
async def test_start_new_kernel_by_name(kernelspec_prefix, kernel_name, runtime):
    require_runtime(runtime)
    status, text, session = await asyncio.to_thread(_run_with_jupyter_client, kernel_name)
    uid, interfaces = text.split(" ", 1)
    assert status == "ok" and int(uid) >= 100_000 and interfaces == "['lo']\n"  # its own unprivileged uid
    assert container_ids_of(session) == [], "shutdown_kernel must remove the container"


def _run_notebook() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("import numpy as np\nvalues = np.arange(10)"),
            nbformat.v4.new_code_cell("print(values.sum())"),
            nbformat.v4.new_code_cell("import os; os.getuid()"),
        ]
    )
    NotebookClient(nb, kernel_name="sandkernel-python", timeout=60, startup_timeout=90).execute()
    return nb


@pytest.mark.smoke  # the quick tier's check of this door (scripts/test.sh --quick)
async def test_nbclient_runs_a_notebook_in_the_sandbox(kernelspec_prefix):
    nb = await asyncio.to_thread(_run_notebook)
    assert nb.cells[1].outputs[0]["text"] == "45\n"
    assert int(nb.cells[2].outputs[0]["data"]["text/plain"]) >= 100_000
    nbformat.validate(nb)


def test_installed_kernelspec_declares_our_provisioner(kernelspec_prefix):
    spec = KernelSpecManager().get_kernel_spec("sandkernel-python")
    assert spec.resource_dir.startswith(str(kernelspec_prefix))
    assert spec.metadata["kernel_provisioner"]["provisioner_name"] == "sandkernel-docker"
    assert spec.interrupt_mode == "message"
