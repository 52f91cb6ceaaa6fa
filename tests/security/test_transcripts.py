"""Transcripts under attack: hostile HTML/JS is never trusted, and a secret the kernel prints
goes to the caller's reply and the session's own transcript, nowhere else."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import nbformat
import pytest
from nbformat.sign import NotebookNotary

from sandkernel.kernels.sandbox.docker_engine import default_engine

from ..gateway_fixtures import BOB, OPERATOR

pytestmark = [pytest.mark.security, pytest.mark.docker]


async def test_hostile_html_and_javascript_are_never_trusted(arena, tmp_path):
    reply = await arena.attack(
        """from IPython.display import HTML, Javascript, display
display(HTML('<img src=x onerror="fetch(`/api/sessions`).then(r => r.text()).then(alert)"><script>alert(1)</script>'))
display(Javascript('document.body.innerHTML = "pwned"'))
get_ipython().display_pub.publish({'text/html': '<script>alert(2)</script>'}, metadata={'trusted': True})"""
    )
    assert reply["status"] == "ok"
    status, notebook = await arena.gateway.request("GET", f"/api/sessions/{arena.attacker['id']}/notebook")
    assert status == 200
    nb = nbformat.from_dict(notebook)
    nbformat.validate(nb)
    assert "signature" not in nb.metadata
    notary = NotebookNotary(data_dir=str(tmp_path), db_file=str(tmp_path / "trust.db"))
    assert not notary.check_signature(nb)
    cells = [c for c in nb.cells if c.cell_type == "code" and "Javascript" in c.source]
    assert cells and all(not c.metadata.get("trusted") for c in cells)
    on_disk = nbformat.read(arena.attacker["path"], as_version=4)
    assert not notary.check_signature(on_disk) and "signature" not in on_disk.metadata


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record) + " " + repr(record.__dict__))


async def test_a_printed_secret_goes_only_to_the_reply_and_the_transcript(arena):
    secret = f"sk-live-{uuid.uuid4().hex}"
    logs = Collect()
    root = logging.getLogger()
    previous = root.level
    root.addHandler(logs)
    root.setLevel(logging.DEBUG)
    try:
        reply = await arena.attack(f"print({secret[::-1]!r}[::-1])")
        await arena.attack("raise ValueError('boom')")
        _, metrics = await arena.gateway.request("GET", "/metrics", token=OPERATOR)
        listed = await arena.gateway.request("GET", "/api/sessions")
    finally:
        root.removeHandler(logs)
        root.setLevel(previous)
    assert reply["text"] == f"{secret}\n"
    status, _ = await arena.gateway.request("GET", f"/api/sessions/{arena.attacker['id']}/notebook")
    assert status == 200  # the notebook GET returns once the file holds every cell (it is written behind)
    transcript = Path(arena.attacker["path"])
    assert secret in transcript.read_text()
    others = [p for p in transcript.parent.glob("*.ipynb") if p != transcript and secret in p.read_text()]
    assert others == [], "the secret reached another transcript"
    _, canary_nb = await arena.gateway.request("GET", f"/api/sessions/{arena.canary['id']}/notebook", token=BOB)
    assert secret not in str(canary_nb)
    assert not [line for line in logs.lines if secret in line], "the secret reached the gateway's logs"
    assert secret not in str(metrics) and secret not in str(listed)
    engine = default_engine()
    [container] = engine.client.containers.list(filters={"label": f"sandkernel.session={arena.attacker['id']}"})
    assert secret.encode() not in container.logs()
    rundir = Path(container.labels["sandkernel.runtime_dir"])
    assert not [p for p in rundir.iterdir() if p.is_file() and secret.encode() in p.read_bytes()]
