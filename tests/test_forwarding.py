"""Forwarding between the gateways of a cluster (issue 18): any gateway answers for any session.

The signature tests are pure. The end-to-end ones run two real ``sandkernel serve`` processes on
this machine's one Docker engine (different state dirs, ports and host ids, one PostgreSQL
catalog from tests/postgres_fixtures.py, one cluster secret, one tokens file; runc, no warm
pool): a session created through A is used through B (JSON and NDJSON execute, the kernel
websocket, a file up and down), another tenant gets 404 through either, a forged or stale
forwarded header is a 401, and with the owner killed B answers 503 naming the host while it
keeps serving its own sessions.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from pathlib import Path

import pytest

from sandkernel.errors import ConfigError
from sandkernel.gateway.base import ApiError
from sandkernel.gateway.cluster.signing import (
    FORWARDED_HEADER,
    MAX_SKEW_SECONDS,
    load_cluster_secret,
    sign,
    verify,
)

SECRET = b"s" * 40
URI = "/api/sessions/abc/execute?stream=1"


def write_secret(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


# -- the cluster secret file ----------------------------------------------------------------


def test_a_good_secret_file_is_read_without_its_newline(tmp_path: Path) -> None:
    path = write_secret(tmp_path / "secret", SECRET + b"\n")
    assert load_cluster_secret(path) == SECRET


@pytest.mark.parametrize(
    ("data", "mode", "words"),
    [
        (None, 0o600, "cannot read"),
        (SECRET, 0o644, "chmod 600"),
        (SECRET, 0o640, "chmod 600"),
        (b"x" * 31, 0o600, "at least 32"),
        (b"   \n", 0o600, "at least 32"),
    ],
    ids=["missing", "world-readable", "group-readable", "short", "blank"],
)
def test_a_bad_secret_file_is_refused_with_what_to_do(
    tmp_path: Path, data: bytes | None, mode: int, words: str
) -> None:
    path = tmp_path / "secret"
    if data is not None:
        write_secret(path, data, mode)
    with pytest.raises(ConfigError, match=words) as caught:
        load_cluster_secret(path)
    assert SECRET.decode() not in str(caught.value)  # the secret itself is never echoed


# -- signing and verifying -------------------------------------------------------------------


def test_a_signed_request_verifies_and_names_its_origin() -> None:
    headers = sign(SECRET, "POST", URI, "host-a")
    assert set(headers) == {FORWARDED_HEADER}
    assert verify(SECRET, headers, "POST", URI) == "host-a"
    # What the header carries is the HMAC-SHA256 the plan says, over method, URI, time, origin.
    fields = dict(part.split("=", 1) for part in headers[FORWARDED_HEADER].split(";"))
    expected = hmac.new(SECRET, f"POST\n{URI}\n{fields['t']}\nhost-a".encode(), hashlib.sha256).hexdigest()
    assert fields["sig"] == expected


def refused(headers: dict[str, str], method: str = "POST", uri: str = URI, secret: bytes = SECRET,
            now: float | None = None) -> str:  # fmt: skip
    with pytest.raises(ApiError) as caught:
        verify(secret, headers, method, uri, now=now)
    assert caught.value.status_code == 401
    assert caught.value.code == "bad_forwarded_signature"
    return caught.value.message


@pytest.mark.parametrize(
    ("method", "uri"),
    [("GET", URI), ("POST", "/api/sessions/abd/execute?stream=1"), ("POST", "/api/sessions/abc/execute")],
    ids=["another-method", "another-session", "another-query"],
)
def test_a_signature_does_not_carry_over_to_another_request(method: str, uri: str) -> None:
    headers = sign(SECRET, "POST", URI, "host-a")
    assert "does not match" in refused(headers, method, uri)


def test_a_tampered_header_is_refused() -> None:
    good = sign(SECRET, "POST", URI, "host-a")[FORWARDED_HEADER]
    fields = dict(part.split("=", 1) for part in good.split(";"))
    other_host = f"host=host-b;t={fields['t']};sig={fields['sig']}"
    later = f"host=host-a;t={int(fields['t']) + 5};sig={fields['sig']}"
    flipped = good[:-1] + ("0" if good[-1] != "0" else "1")
    for value in (other_host, later, flipped):
        assert "does not match" in refused({FORWARDED_HEADER: value})


def test_a_header_signed_with_another_secret_is_refused() -> None:
    headers = sign(b"t" * 40, "POST", URI, "host-a")
    assert "another cluster secret" in refused(headers)


def test_an_old_header_replayed_is_refused_and_a_fresh_one_is_not() -> None:
    signed_at = time.time() - MAX_SKEW_SECONDS - 5
    headers = sign(SECRET, "POST", URI, "host-a", now=signed_at)
    assert "replayed" in refused(headers)
    assert verify(SECRET, headers, "POST", URI, now=signed_at + MAX_SKEW_SECONDS - 1) == "host-a"
    ahead = sign(SECRET, "POST", URI, "host-a", now=time.time() + MAX_SKEW_SECONDS + 5)
    assert "clocks" in refused(ahead)


@pytest.mark.parametrize("value", ["", "junk", "host=a;t=now;sig=00", "host=;t=1;sig=00", "host=a;t=1"])
def test_a_malformed_header_is_refused(value: str) -> None:
    assert "expected host=" in refused({FORWARDED_HEADER: value})
