"""sandkernel.truncation: one cut function and one marker wording (pure logic)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

from sandkernel.truncation import ClipResult, clip_chars, clip_text, cut_marker


def test_the_one_marker_wording():
    assert cut_marker(5, "bytes", "image/png", "over the budget", "ab") == (
        "\n…[sandkernel: 5 bytes of image/png cut here (over the budget); sha256 ab]…\n"
    )
    assert cut_marker(7) == "\n…[sandkernel: 7 characters of output cut here]…\n"
    assert cut_marker(None, what="the rest of the output") == "\n…[sandkernel: the rest of the output cut here]…\n"


def test_clip_text_keeps_head_and_tail_within_the_byte_limit():
    text = "é" * 1000 + "END"  # two bytes a character: cuts must not split one
    result = clip_text(text, 101)
    assert isinstance(result, ClipResult) and result.truncated
    head, _, tail = result.text.partition(cut_marker(result.cut, "bytes"))
    assert head == "é" * 25 and tail.endswith("END") and result.kept <= 101
    assert result.kept + result.cut == len(text.encode())
    clipped, kept, cut = clip_text("short", 100)  # still unpacks as the old (text, kept, cut) tuple
    assert (clipped, kept, cut) == ("short", 5, 0)
    assert clip_text("abc", 0).kept == 0 and "3 bytes of output cut here" in clip_text("abc", 0).text
    assert clip_text("abc", -5).cut == 3


def test_clip_chars_names_the_whole_text_by_sha256():
    source = "a" * 100 + "b" * 100
    clipped = clip_chars(source, 20, "source", "over the cap")
    digest = hashlib.sha256(source.encode()).hexdigest()
    assert clipped == "a" * 10 + cut_marker(180, "characters", "source", "over the cap", digest) + "b" * 10
    assert clip_chars("short", 20) == "short"


def test_the_client_library_loads_without_the_server():
    """agent/ is a client library: it must not pull in the gateway (it used gateway.budget.clip_text)."""
    code = (
        "import sys, sandkernel.agent.tools, sandkernel.agent.client, sandkernel.agent.sync_client\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('sandkernel.gateway', 'sandkernel.kernels', "
        "'sandkernel.notebooks', 'tornado.web')))\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
