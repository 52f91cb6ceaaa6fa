"""The execute reply's budget (gateway/budget.py), pure logic: every MIME value is text or binary by
sandkernel.mime's one rule, so no type escapes both budgets. Every test here but
test_errors_are_kept_past_the_budget (a guard) failed on the budget that listed four image types by
hand and counted neither JSON values nor the kernel's metadata."""

from __future__ import annotations

import json

import pytest

from sandkernel.gateway.budget import OutputBudget, apply_budget
from sandkernel.kernels.execution.outputs import OutputCollector

from .test_outputs import collect, display


def rich(data: dict, kind: str = "display_data") -> dict:
    output = {"output_type": kind, "data": data, "metadata": {}}
    if kind == "execute_result":
        output["execution_count"] = 1
    return output


def reply_bytes(outputs: list[dict]) -> int:
    return len(json.dumps(outputs).encode())


@pytest.mark.parametrize("mime", ["image/webp", "application/pdf", "video/mp4", "application/x-never-heard-of"])
def test_binary_types_count_against_the_image_budget(mime):
    big = "A" * 3_000_000  # over max_image_bytes (2 MiB)
    outputs, truncation = apply_budget([rich({mime: big, "text/plain": "<object>"})], OutputBudget())
    assert mime not in outputs[0]["data"]
    assert truncation["truncated"] and truncation["images_omitted"] == 1
    assert outputs[0]["data"]["text/plain"].startswith("<object>")
    assert f"3000000 bytes of {mime} cut here" in outputs[0]["data"]["text/plain"]
    assert reply_bytes(outputs) < 1000


@pytest.mark.parametrize("mime", ["image/webp", "application/pdf"])
def test_the_image_count_covers_every_binary_type(mime):
    outputs, truncation = apply_budget([rich({mime: "QUJD"}) for _ in range(20)], OutputBudget(max_images=3))
    assert sum(mime in o["data"] for o in outputs) == 3 and truncation["images_omitted"] == 17


def test_json_values_share_the_text_budget_whole_or_not_at_all():
    payload = {"rows": ["x" * 100] * 10_000}  # ~1 MB of application/json (a dict, not a string)
    outputs, truncation = apply_budget(
        [rich({"application/json": payload, "text/plain": "<rows>"}, "execute_result")], OutputBudget()
    )
    data = outputs[0]["data"]
    assert "application/json" not in data and "bytes of application/json cut here" in data["text/plain"]
    assert truncation["truncated"] and truncation["text_bytes_cut"] >= 1_000_000
    small = apply_budget([rich({"application/json": {"a": 1}})], OutputBudget())[0]
    assert small[0]["data"]["application/json"] == {"a": 1}


def test_many_small_outputs_past_the_budget_do_not_grow_the_reply():
    outputs, truncation = apply_budget(
        [{"output_type": "stream", "name": "stdout", "text": "y" * 100} for _ in range(20_000)],
        OutputBudget(max_text_bytes=10_000),
    )
    assert len(outputs) == 20_000  # order and count kept: nothing (an error least of all) is dropped
    text = "".join(o["text"] for o in outputs)
    assert len(text.encode()) < 10_000 + 200 and text.count("cut here") == 1
    assert text.startswith("y" * 10_000 + "\n…[sandkernel: the rest of the output cut here")
    assert truncation["text_bytes_cut"] == 20_000 * 100 - 10_000


def test_errors_are_kept_past_the_budget():
    flood = [{"output_type": "stream", "name": "stdout", "text": "z" * 5000}] * 5
    error = {"output_type": "error", "ename": "ValueError", "evalue": "bad", "traceback": ["ValueError: bad"]}
    outputs, _ = apply_budget([*flood, error], OutputBudget(max_text_bytes=1000))
    assert outputs[-1] == error


def test_kernel_metadata_counts_against_the_execution_byte_bound():
    huge = {"application/x-anything": {"blob": "m" * 100_000}}
    messages = [
        {"header": {"msg_type": "display_data"}, "content": {"data": {"text/plain": "x"}, "metadata": huge}}
        for _ in range(20)
    ]
    c: OutputCollector = collect(messages, max_bytes=50_000)
    held = sum(len(json.dumps(o)) for o in c.finished_outputs())
    assert held < 50_000 + 20 * 1000, held  # ~2 MB of metadata, kept within the bound
    marked = c.finished_outputs()[-1]
    assert "bytes of metadata cut here" in marked["data"]["text/plain"] and c.bytes_omitted > 1_000_000


def test_collected_images_of_any_type_are_budgeted_end_to_end():
    c = collect([display({"image/webp": "UklG" * 1_000_000, "text/plain": "<webp>"})])
    outputs, truncation = apply_budget([dict(o) for o in c.finished_outputs()], OutputBudget())
    assert "image/webp" not in outputs[0]["data"] and truncation["images_omitted"] == 1
