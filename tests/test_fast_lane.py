"""What the fast lane of a cluster gateway relays itself, and what it leaves to tornado
(gateway/cluster/fast_lane.py): pure. The lane at work between real gateways, and hostile
requests through it, are in tests/test_forwarding.py."""

from __future__ import annotations

import pytest

from sandkernel.gateway.cluster.fast_lane import MAX_BODY_BYTES, plain_request

SID = "0123456789abcdef0123456789abcdef"
HEAD = f"POST /api/sessions/{SID}/execute HTTP/1.1\r\nHost: gw\r\nAuthorization: token t\r\nContent-Length: 15\r\n"
BODY = b'{"code": "1+1"}'


def test_a_plain_execute_is_taken_with_its_headers_and_body_bounds():
    data = (HEAD + "Content-Type: application/json\r\n\r\n").encode() + BODY
    request = plain_request(data)
    assert request is not None
    assert (request.method, request.target, request.session_id) == ("POST", f"/api/sessions/{SID}/execute", SID)
    assert request.header("authorization") == "token t" and request.header("Content-Type") == "application/json"
    assert data[request.head_size : request.size] == BODY and request.size == len(data)


def test_a_streamed_execute_is_taken_with_its_query():
    request = plain_request((HEAD.replace("/execute", "/execute?stream=1") + "\r\n").encode() + BODY)
    assert request is not None and request.target == f"/api/sessions/{SID}/execute?stream=1"


def test_a_head_whose_body_has_not_come_yet_is_taken_and_a_partial_head_is_not():
    head = (HEAD + "\r\n").encode()
    request = plain_request(head)  # the client writes its body next
    assert request is not None and request.length == len(BODY) and request.size == len(head) + len(BODY)
    assert plain_request(head[:-2]) is None
    assert plain_request(head[:20]) is None


@pytest.mark.parametrize(
    "head",
    [
        HEAD + "Transfer-Encoding: chunked\r\n",
        HEAD + "Content-Length: 15\r\n",  # twice
        HEAD.replace("Content-Length: 15", "Content-Length: +15"),
        HEAD + " folded: continuation\r\n",
        HEAD + "No-Colon\r\n",
        HEAD + "Bad Name: x\r\n",
        HEAD + "Control: a\x01b\r\n",
        HEAD + "Connection: close\r\n",
        HEAD + "Connection: upgrade\r\nUpgrade: websocket\r\n",
        HEAD + "Expect: 100-continue\r\n",
        HEAD + "X-Sandkernel-Forwarded: host=h;t=1;sig=00\r\n",
        HEAD + "x-sandkernel-place-here: 1\r\n",
        HEAD.replace("HTTP/1.1", "HTTP/1.0"),
        HEAD.replace("/execute", "/execute?token=t"),
        HEAD.replace("/execute", "/execute?stream=1&x=2"),
        HEAD.replace(f"/api/sessions/{SID}/execute", "/api/sessions"),
        HEAD.replace(f"/api/sessions/{SID}/execute", f"/api/sessions/{SID}/../../kernels"),
        HEAD.replace(f"/api/sessions/{SID}/execute", f"/api/sessions/{SID}/files/a.txt"),
        HEAD.replace(f"/api/sessions/{SID}/execute", "/api/sessions/NOT-HEX/execute"),
        HEAD.replace("POST", "PATCH"),
        HEAD.replace("POST ", "POST  "),
        HEAD.replace("Content-Length: 15", f"Content-Length: {MAX_BODY_BYTES + 1}"),
    ],
    ids=[
        "chunked",
        "two-lengths",
        "signed-length",
        "folded",
        "no-colon",
        "space-in-name",
        "control-char",
        "close",
        "upgrade",
        "expect",
        "forwarded-header",
        "place-here-header",
        "http-1.0",
        "query",
        "stream-and-more",
        "collection",
        "dot-dot",
        "file-path",
        "not-hex",
        "patch",
        "double-space",
        "too-large",
    ],
)
def test_anything_but_a_plain_request_is_left_to_tornado(head):
    assert plain_request((head + "\r\n").encode() + BODY) is None


def test_a_head_that_is_not_ascii_is_left_to_tornado():
    assert plain_request((HEAD + "Name: caf").encode() + "é\r\n\r\n".encode() + BODY) is None
