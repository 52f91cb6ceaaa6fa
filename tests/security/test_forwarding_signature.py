"""The signature between the gateways of a cluster (issue 30, item 10): it covers the method,
URL, time, origin, a nonce, the body and the credential, so a forwarded request seen on one
plain-HTTP hop can be neither sent again nor sent with another body or token. Pure: the
end-to-end refusals by two gateways are in tests/test_forwarding.py
(``test_a_forged_or_stale_forwarded_header_is_401_and_a_forwarded_request_is_not_forwarded_again``)."""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

import pytest

from sandkernel.gateway.cluster.signing import FORWARDED_HEADER, MAX_SKEW_SECONDS, NonceLedger, sign, verify
from sandkernel.gateway.http_api import ApiError

from ..gateway_fixtures import ALICE, BOB

pytestmark = pytest.mark.security

SECRET = b"s" * 40
URI = "/api/sessions/abc/execute?stream=1"
CREDENTIAL = f"token {ALICE}"
BODY = b'{"code": "print(1)"}'


def signed(method: str = "POST", uri: str = URI, body: bytes = BODY, **kw: Any) -> dict[str, str]:
    """Signed as a forwarded request of alice's with BODY, its Authorization beside it."""
    return {**sign(SECRET, method, uri, "host-a", body=body, credential=CREDENTIAL, **kw), "Authorization": CREDENTIAL}


def fields_of(headers: dict[str, str]) -> dict[str, str]:
    return dict(part.split("=", 1) for part in headers[FORWARDED_HEADER].split(";"))


def test_a_signed_request_verifies_and_names_its_origin() -> None:
    headers = signed()
    assert set(sign(SECRET, "POST", URI, "host-a")) == {FORWARDED_HEADER}
    forwarded = verify(SECRET, headers, "POST", URI)
    assert forwarded.origin == "host-a"
    forwarded.check_body(BODY)
    # What the header carries is the HMAC-SHA256 the module says, over method, URI, time, origin,
    # nonce, the body's SHA-256 and the credential's SHA-256.
    fields = fields_of(headers)
    assert fields["b"] == hashlib.sha256(BODY).hexdigest()
    message = "\n".join(
        ["POST", URI, fields["t"], "host-a", fields["n"], fields["b"], hashlib.sha256(CREDENTIAL.encode()).hexdigest()]
    )
    assert fields["sig"] == hmac.new(SECRET, message.encode(), hashlib.sha256).hexdigest()
    assert fields["n"] != fields_of(signed())["n"]  # a nonce per request


def refused(headers: dict[str, str], method: str = "POST", uri: str = URI, secret: bytes = SECRET,
            now: float | None = None, nonces: NonceLedger | None = None) -> str:  # fmt: skip
    with pytest.raises(ApiError) as caught:
        verify(secret, headers, method, uri, nonces, now=now)
    assert caught.value.status_code == 401
    assert caught.value.code == "bad_forwarded_signature"
    return caught.value.message


@pytest.mark.parametrize(
    ("method", "uri"),
    [("GET", URI), ("POST", "/api/sessions/abd/execute?stream=1"), ("POST", "/api/sessions/abc/execute")],
    ids=["another-method", "another-session", "another-query"],
)
def test_a_signature_does_not_carry_over_to_another_request(method: str, uri: str) -> None:
    assert "does not match" in refused(signed(), method, uri)


def test_a_signature_does_not_carry_over_to_another_body_or_credential() -> None:
    """Issue 30, item 10: one plain-HTTP hop seen, its header could be sent again within the
    window with another body. The body's digest is signed and checked once the body is in; the
    credential's too (the header vouches for the token it came with, no other)."""
    forwarded = verify(SECRET, signed(), "POST", URI)
    with pytest.raises(ApiError) as caught:
        forwarded.check_body(b'{"code": "import os; os.system(\'id\')"}')
    assert caught.value.status_code == 401 and "not the one 'host-a' signed" in caught.value.message
    # the body's digest in the header changed to match another body: the signature no longer does
    fields = fields_of(signed())
    fields["b"] = hashlib.sha256(b"{}").hexdigest()
    altered = ";".join(f"{k}={v}" for k, v in fields.items())
    assert "does not match" in refused({FORWARDED_HEADER: altered, "Authorization": CREDENTIAL})
    # another tenant's token beside the header, or none
    assert "does not match" in refused({**signed(), "Authorization": f"token {BOB}"})
    assert "does not match" in refused({FORWARDED_HEADER: signed()[FORWARDED_HEADER]})


def test_a_nonce_is_accepted_once() -> None:
    ledger = NonceLedger()
    headers = signed()
    assert verify(SECRET, headers, "POST", URI, ledger).origin == "host-a"
    assert "used before" in refused(headers, nonces=ledger)
    assert verify(SECRET, signed(), "POST", URI, ledger).origin == "host-a"  # a fresh one is fine
    assert len(ledger) == 2
    # Only a request whose signature verified is written down: a forged one fills nothing.
    refused({**signed(), "Authorization": f"token {BOB}"}, nonces=ledger)
    assert len(ledger) == 2


def test_the_nonce_ledger_forgets_after_its_window_and_fails_closed_when_full() -> None:
    ledger = NonceLedger(limit=2, keep_seconds=60)
    ledger.use("a" * 32, now=0)
    ledger.use("b" * 32, now=10)
    with pytest.raises(ApiError) as full:
        ledger.use("c" * 32, now=20)  # full: refused, never a replay let through for want of room
    assert full.value.status_code == 503 and "retry in a few seconds" in full.value.message
    ledger.use("c" * 32, now=61)  # the first one expired, its room is free
    with pytest.raises(ApiError) as replayed:
        ledger.use("b" * 32, now=69)  # still inside its window
    assert replayed.value.status_code == 401 and "used before" in replayed.value.message
    assert len(ledger) == 2


def test_a_tampered_header_is_refused() -> None:
    good = signed()[FORWARDED_HEADER]
    fields = fields_of(signed())
    other_host = ";".join(f"{k}={v}" for k, v in {**fields, "host": "host-b"}.items())
    later = ";".join(f"{k}={v}" for k, v in {**fields, "t": str(int(fields["t"]) + 5)}.items())
    other_nonce = ";".join(f"{k}={v}" for k, v in {**fields, "n": "f" * 32}.items())
    flipped = good[:-1] + ("0" if good[-1] != "0" else "1")
    for value in (other_host, later, other_nonce, flipped):
        assert "does not match" in refused({FORWARDED_HEADER: value, "Authorization": CREDENTIAL})


def test_a_header_signed_with_another_secret_is_refused() -> None:
    headers = {**sign(b"t" * 40, "POST", URI, "host-a", body=BODY, credential=CREDENTIAL), "Authorization": CREDENTIAL}
    assert "another cluster secret" in refused(headers)


def test_an_old_header_replayed_is_refused_and_a_fresh_one_is_not() -> None:
    signed_at = time.time() - MAX_SKEW_SECONDS - 5
    headers = signed(now=signed_at)
    assert "replayed" in refused(headers)
    assert verify(SECRET, headers, "POST", URI, now=signed_at + MAX_SKEW_SECONDS - 1).origin == "host-a"
    ahead = signed(now=time.time() + MAX_SKEW_SECONDS + 5)
    assert "clocks" in refused(ahead)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "junk",
        "host=a;t=now;sig=00",
        "host=;t=1;sig=00",
        "host=a;t=1",
        "host=a;t=1;sig=00",  # the fields of the first version: no nonce, no body digest
        f"host=a;t=1;n=xyz;b={'0' * 64};sig=00",
        f"host=a;t=1;n={'0' * 32};b=00;sig=00",
    ],
)
def test_a_malformed_header_is_refused(value: str) -> None:
    assert "expected host=" in refused({FORWARDED_HEADER: value})
