"""Byte bounds on kernel output in the host (pure logic, scripted messages): the per-execution
output budget of OutputCollector, the reply budget's view of its markers, and the per-session
transcript cap of TranscriptRecorder. The end-to-end flood runs in tests/security/test_floods.py."""

from __future__ import annotations

import asyncio
import hashlib
import json

import nbformat

from sandkernel.gateway.budget import OutputBudget, apply_budget
from sandkernel.kernels.execution.outputs import ExecutionResult, ExecutionStatus
from sandkernel.notebooks.recorder import TranscriptRecorder

from .test_outputs import collect, display, stream


def error(traceback: list[str]) -> dict:
    return {"header": {"msg_type": "error"}, "content": {"ename": "E", "evalue": "v", "traceback": traceback}}


def as_notebook(outputs) -> nbformat.NotebookNode:
    cell = {
        "cell_type": "code",
        "id": "c1",
        "source": "",
        "outputs": list(outputs),
        "execution_count": 1,
        "metadata": {},
    }
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.from_dict(cell))
    return nb


def test_outputs_past_the_byte_budget_become_markers_with_size_and_sha256():
    blob = "x" * 6000
    c = collect(
        [display({"text/plain": blob}), display({"text/plain": blob, "image/png": "iVBOR" * 2000})], max_bytes=10_000
    )
    first, second = c.finished_outputs()
    assert first["data"]["text/plain"] == blob
    assert "image/png" not in second["data"]
    marker = second["data"]["text/plain"]
    assert "6000 bytes of text/plain cut here" in marker and hashlib.sha256(blob.encode()).hexdigest() in marker
    assert "10000 bytes of image/png cut here" in marker
    omitted = second["metadata"]["sandkernel"]["omitted"]
    assert [(o["mime"], o["bytes"]) for o in omitted] == [("text/plain", 6000), ("image/png", 10000)]
    assert c.bytes_omitted == 16000 and c.bytes_held < 10_000
    nbformat.validate(as_notebook(c.finished_outputs()))


def test_streams_and_tracebacks_are_bounded_too():
    c = collect(
        [display({"text/plain": "y" * 9000}), stream("a" * 5000, "stderr"), stream("b"), error(["t" * 50_000])],
        max_bytes=10_000,
    )
    outputs = c.finished_outputs()
    assert [o["output_type"] for o in outputs] == ["display_data", "stream", "error"]  # "a" * 5000 did not fit
    assert c.outputs_dropped == 1 and c.chars_cut == 5000
    assert "50000 bytes of traceback" in outputs[-1]["traceback"][0] and len(c.error.traceback[0]) < 300
    nbformat.validate(as_notebook(outputs))


def test_updates_and_clears_keep_the_count_right():
    c = collect(
        [
            display({"text/plain": "v" * 8000}, "bar"),
            display({"text/plain": "w" * 9000}, "bar", "update_display_data"),
            {"header": {"msg_type": "clear_output"}, "content": {"wait": False}},
            display({"text/plain": "z" * 9000}),
        ],
        max_bytes=10_000,
    )
    (out,) = c.finished_outputs()
    assert out["data"]["text/plain"] == "z" * 9000 and c.bytes_held == 9000


def test_the_reply_budget_counts_images_the_collector_replaced():
    c = collect([display({"image/png": "A" * 20_000, "text/plain": "<Figure>"})], max_bytes=1000)
    outputs, truncation = apply_budget([dict(o) for o in c.finished_outputs()], OutputBudget())
    assert truncation["truncated"] and truncation["images_omitted"] == 1
    assert outputs[0]["data"]["text/plain"].startswith("<Figure>")
    forged = {"output_type": "display_data", "data": {}, "metadata": {"sandkernel": {"omitted": "junk"}}}
    assert apply_budget([forged], OutputBudget())[1]["truncated"] is False  # kernel metadata of the wrong shape


def _result(outputs) -> ExecutionResult:
    return ExecutionResult(ExecutionStatus.OK, tuple(outputs), 1, "2026-01-01T00:00:00Z", 0.1)


def test_the_transcript_stays_under_its_cap_and_valid(tmp_path):
    cap = 4 * 1024 * 1024
    recorder = TranscriptRecorder(tmp_path / "t.ipynb", {"session_id": "s"}, max_bytes=cap)
    big = {"output_type": "display_data", "data": {"text/plain": "q" * 1_000_000}, "metadata": {}}

    async def run():
        await recorder.start()
        for i in range(20):
            await recorder.record(f"cell {i}", _result([big]))
        await recorder.record("print('x' * 10**7)" + " " * 2_000_000, _result([]))
        await recorder.note("still recording notes")
        await recorder.close()

    asyncio.run(run())
    size = (tmp_path / "t.ipynb").stat().st_size
    assert size <= cap, size
    nb = nbformat.read(tmp_path / "t.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    whole = [c for c in code if c.outputs and c.outputs[0]["data"]["text/plain"] == "q" * 1_000_000]
    marked = [c for c in code if c.outputs and "sha256" in c.outputs[0]["data"]["text/plain"]]
    assert 2 <= len(whole) <= 3 and marked, (len(whole), len(marked))
    assert code[len(whole)].source == f"cell {len(whole)}", "cells after the full share are kept, with markers"
    clipped = code[-1].source
    assert clipped.startswith("print('x' * 10**7)") and "characters of source" in clipped and len(clipped) < 20_000
    assert "transcript_cap" not in nb.metadata["sandkernel"] or nb.metadata["sandkernel"]["transcript_cap"]
    assert json.loads((tmp_path / "t.ipynb").read_text())["nbformat"] == 4


def test_past_the_cap_cells_are_counted_not_recorded(tmp_path):
    cap = 64 * 1024
    recorder = TranscriptRecorder(tmp_path / "t.ipynb", {"session_id": "s"}, max_bytes=cap)

    async def run():
        await recorder.start()
        for i in range(200):
            await recorder.record(f"print({i})  # " + "c" * 900, _result([]))
        await recorder.close()

    asyncio.run(run())
    assert (tmp_path / "t.ipynb").stat().st_size <= cap
    nb = nbformat.read(tmp_path / "t.ipynb", as_version=4)
    nbformat.validate(nb)
    kept = len(nb.cells)
    assert 0 < kept < 200 and nb.metadata["sandkernel"]["transcript_cap"]["cells_not_recorded"] == 200 - kept
