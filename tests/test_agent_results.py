"""What goes back to the model from a tool call: bounded text, images downscaled, hostile images
refused unread. No containers needed: these shape results the sandbox already returned."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image as PILImage

from sandkernel.agent.execution import Execution, Image
from sandkernel.agent.images import image_block
from sandkernel.agent.tools import MAX_RESULT_BYTES, code_for, result_block
from sandkernel.images import MAX_EDGE, MAX_PIXELS


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    PILImage.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_small_images_pass_through_untouched():
    data = png(640, 480)
    block = image_block(Image("image/png", data))
    assert block["source"] == {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}


def test_large_images_are_downscaled_within_the_api_bounds():
    block = image_block(Image("image/png", png(4000, 3000)))
    with PILImage.open(io.BytesIO(base64.b64decode(block["source"]["data"]))) as small:
        width, height = small.size
    assert max(width, height) <= MAX_EDGE and width * height <= MAX_PIXELS * 1.01
    assert abs(width / height - 4000 / 3000) < 0.01  # aspect ratio kept


def test_a_decompression_bomb_is_refused_unread():
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
    bomb = b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    refusal = image_block(Image("image/png", bomb))
    assert isinstance(refusal, str) and "too large to decode safely" in refusal
    assert image_block(Image("image/png", b"\x89PNG garbage")).startswith("[image not shown: it could not be read")
    assert "accepts PNG, JPEG" in image_block(Image("image/svg+xml", b"<svg/>"))


def test_long_output_is_bounded_with_the_gateway_marker():
    execution = Execution(
        "ok", [{"output_type": "stream", "name": "stdout", "text": "x" * 500_000}], 1, 0.1, text="x" * 500_000
    )
    block = result_block("toolu_1", execution)
    text = block["content"][0]["text"]
    assert len(text.encode()) < MAX_RESULT_BYTES + 200 and "bytes of output cut here" in text
    assert block["is_error"] is False


def test_errors_and_endings_are_told_to_the_model():
    error = {"name": "ValueError", "value": "bad", "traceback": ["\x1b[31mTraceback\x1b[0m", "ValueError: bad"]}
    block = result_block("t", Execution.from_reply({"status": "error", "outputs": [], "duration": 0, "error": error}))
    assert block["is_error"] is True and "\x1b" not in block["content"][0]["text"]
    assert "ValueError: bad" in block["content"][0]["text"]
    timeout = Execution.from_reply({"status": "timeout", "outputs": [], "duration": 5, "ended_by": "interrupt"})
    assert "ended as timeout (interrupt)" in result_block("t", timeout)["content"][0]["text"]


def test_file_tools_are_readable_code_that_leaves_no_names_behind():
    code = code_for("write_file", {"path": "out/a.txt", "content": "it's\n"})
    assert code.startswith("# write_file('out/a.txt')") and '"it\'s\\n"' in code
    namespace: dict = {}
    compile(code, "<tool>", "exec")
    exec(compile(code_for("list_files", {}), "<tool>", "exec"), namespace)
    assert set(namespace) == {"__builtins__"}
