"""OutputCollector: ordering, merging and the memory bound (pure logic, scripted messages)."""

import asyncio

from sandkernel.kernels.execution.outputs import OutputCollector


def stream(text: str, name: str = "stdout") -> dict:
    return {"header": {"msg_type": "stream"}, "content": {"name": name, "text": text}}


def display(data: dict, display_id: str | None = None, msg_type: str = "display_data") -> dict:
    content = {"data": data, "metadata": {}}
    if display_id:
        content["transient"] = {"display_id": display_id}
    return {"header": {"msg_type": msg_type}, "content": content}


def collect(messages, **kwargs) -> OutputCollector:
    collector = OutputCollector(**kwargs)

    async def run():
        for m in messages:
            await collector.add(m)

    asyncio.run(run())
    return collector


def test_streams_merge_and_order_is_kept():
    c = collect([stream("a"), stream("b"), stream("e", "stderr"), display({"text/plain": "d"}), stream("c")])
    out = c.finished_outputs()
    assert [(o["output_type"], o.get("text")) for o in out] == [
        ("stream", "ab"),
        ("stream", "e"),
        ("display_data", None),
        ("stream", "c"),
    ]


def test_flood_keeps_head_and_tail_within_the_bound():
    c = collect([stream(f"line {i}\n") for i in range(100000)], max_stream_chars=1000)
    (out,) = c.finished_outputs()
    assert out["text"].startswith("line 0\nline 1\n") and out["text"].endswith("line 99999\n")
    assert "characters of output cut here" in out["text"]
    assert len(out["text"]) < 1100 and c.chars_cut > 600000


def test_output_count_is_bounded():
    c = collect([display({"text/plain": str(i)}) for i in range(50)], max_outputs=10)
    assert len(c.finished_outputs()) == 10 and c.outputs_dropped == 40


def test_update_and_clear_output():
    c = collect(
        [
            display({"text/plain": "v1"}, "bar"),
            display({"text/plain": "v2"}, "bar", "update_display_data"),
            stream("x"),
            {"header": {"msg_type": "clear_output"}, "content": {"wait": True}},
            stream("y"),
        ]
    )
    assert [o.get("text") for o in c.finished_outputs()] == ["y"]
    c = collect([display({"text/plain": "v1"}, "bar"), display({"text/plain": "v2"}, "bar", "update_display_data")])
    assert c.finished_outputs()[0]["data"] == {"text/plain": "v2"}


def test_malformed_kernel_messages_become_valid_outputs():
    """Kernel output is untrusted: a message missing fields or carrying the wrong types must
    neither raise in the execute path nor make the transcript invalid nbformat."""
    import nbformat

    messages = [
        {"header": {"msg_type": "stream"}, "content": {"name": 7}},
        {"header": {"msg_type": "display_data"}, "content": {"data": 5, "metadata": "x"}},
        {"header": {"msg_type": "display_data"}, "content": {"data": {"foo": 12, "application/json": {"a": 1}}}},
        {"header": {"msg_type": "execute_result"}, "content": {"data": {"text/plain": ["4", "2"]}, "execution_count": "1"}},
        {"header": {"msg_type": "error"}, "content": {"ename": None, "traceback": "not a list"}},
    ]
    c = collect(messages)
    outputs = [{k: v for k, v in o.items() if not k.startswith("_")} for o in c.finished_outputs()]
    assert [o["output_type"] for o in outputs] == ["stream", "display_data", "display_data", "execute_result", "error"]
    assert outputs[2]["data"] == {"foo": "12", "application/json": {"a": 1}}
    assert outputs[3]["data"]["text/plain"] == "42" and outputs[3]["execution_count"] is None
    assert c.error is not None and c.error.name == "Error"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x", outputs=outputs)])
    nbformat.validate(notebook)
