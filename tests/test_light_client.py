"""The client alone (issue 32): ``pip install sandkernel`` on an agent's host that only calls a
gateway brings tornado and nothing of the server (no Docker SDK, kernel, Prometheus or model
SDK), runs the README's client example against a gateway started elsewhere (this test's, in
another process's view: the example runs in its own interpreter), and a server command run
there says which extra to install instead of failing with a traceback.

The venv is built offline: sandkernel's wheel from a copy of the checkout (tests/test_packaging.py
builds it the same way) and tornado from the kernel image's wheelhouse, which ``sandkernel image
build`` fills and every docker run has."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from asyncio.subprocess import PIPE
from pathlib import Path

import pytest

from .gateway_fixtures import ALICE, gateway_fixture
from .test_packaging import ROOT, run, wheel  # noqa: F401 (wheel: the module-scoped fixture)

pytestmark = pytest.mark.docker

WHEELHOUSE = ROOT / "kernel-image" / "wheelhouse"
SERVER_ONLY = ("docker", "ipykernel", "jupyter-client", "pyzmq", "prometheus-client", "anthropic", "pillow", "nbformat")
EXAMPLE_MARK = "<!-- the client-only example: tests/test_light_client.py runs it -->"

gateway = gateway_fixture()


@pytest.fixture(scope="module")
def client_venv(wheel, tmp_path_factory) -> Path:  # noqa: F811 (the imported fixture)
    """A venv holding the wheel as `pip install sandkernel` installs it: its own dependencies
    only, resolved by pip from the wheelhouse (no index)."""
    assert any(WHEELHOUSE.glob("tornado-*.whl")), f"no tornado wheel in {WHEELHOUSE}: build the kernel image first"
    env = tmp_path_factory.mktemp("client-venv")
    run(sys.executable, "-m", "venv", "--without-pip", env)
    pip = (sys.executable, "-m", "pip", "--python", env / "bin" / "python")
    run(*pip, "install", "-q", "--no-index", "--find-links", WHEELHOUSE, wheel)
    return env


def installed(venv: Path) -> set[str]:
    listed = run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "list", "--format=json").stdout
    return {entry["name"].lower() for entry in json.loads(listed)}


def readme_example() -> str:
    """The README's client-only example: the python block after its mark."""
    text = (ROOT / "README.md").read_text()
    assert EXAMPLE_MARK in text, "the README lost its client-only example"
    block = re.search(r"```python\n(.*?)```", text[text.index(EXAMPLE_MARK) :], re.DOTALL)
    assert block is not None
    return block.group(1)


def test_the_client_alone_installs_none_of_the_server(client_venv):
    names = installed(client_venv)
    assert {"sandkernel", "tornado"} <= names, names
    assert not names & set(SERVER_ONLY), f"the client-only install pulled in {sorted(names & set(SERVER_ONLY))}"


async def test_the_readme_client_example_runs_from_the_client_alone(client_venv, gateway, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SANDKERNEL_", "PYTHON"))}
    env |= {"SANDKERNEL_URL": gateway.url, "SANDKERNEL_TOKEN": ALICE}
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    # The gateway runs on this test's event loop: the example runs beside it, never blocking it.
    proc = await asyncio.create_subprocess_exec(
        client_venv / "bin" / "python", script, stdout=PIPE, stderr=PIPE, cwd=tmp_path, env=env
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    assert stdout.decode().split() == ["2.8", "42"], stdout  # what the example's comments promise
    status, sessions = await gateway.request("GET", "/api/sessions")
    assert status == 200 and sessions == [], sessions  # the example's `with` deleted its session


def test_a_server_command_in_the_client_alone_names_its_extra(client_venv):
    for argv, extra in ((["serve", "--port", "1"], "server"), (["run", "1+1"], "server"), (["mcp"], "mcp")):
        proc = subprocess.run(
            [client_venv / "bin" / "sandkernel", *argv], capture_output=True, text=True, timeout=120, cwd="/"
        )
        assert proc.returncode == 2, (argv, proc.stderr)
        assert f"pip install 'sandkernel[{extra}]'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    help_text = run(client_venv / "bin" / "sandkernel", "--help").stdout
    assert "serve" in help_text and "agent" in help_text
