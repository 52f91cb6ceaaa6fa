"""Signed requests between the gateways of a cluster: the ``X-Sandkernel-Forwarded`` header.

A gateway that forwards a tenant's request to the host holding the session adds one header,
``X-Sandkernel-Forwarded: host=<origin>;t=<unix seconds>;n=<nonce>;b=<body sha256>;sig=<hex>``,
where ``sig`` is HMAC-SHA256, with the secret every gateway of the cluster shares
(``--cluster-secret-file``), over the method, the path and query, the time, the origin, the
nonce, the SHA-256 of the body and the SHA-256 of the request's ``Authorization`` header. The
tenant's own ``Authorization`` travels beside it: the owner authenticates the tenant itself, so
the signature grants nothing a tenant lacks. What it does say is "a gateway of this cluster sent
this request, with this body and this credential, now, once": the receiver serves such a request
itself and never forwards it again (the loop guard), and a create carrying it (with
``X-Sandkernel-Place-Here``) is placed where it lands.

Why the body, the credential and the nonce: without them, anyone who saw one plain-HTTP hop could
send the same header again within the window with another body (another tenant's token cannot
be swapped in: that token is checked anyway, but the header must not vouch for it). Each nonce
is accepted once (:class:`NonceLedger`, kept as long as a signature can be fresh). The body's
digest is checked once the body is in (:meth:`Forwarded.check_body`). None of this replaces TLS between
gateways outside a private network: the tenants' tokens and the code travel in the clear.

A header that does not verify (another secret, another method, URL, body or credential, more
than :data:`MAX_SKEW_SECONDS` old or ahead, a nonce seen before: a replay) is a 401 with a
sentence saying which, and is logged; the comparison is constant-time.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from sandkernel.errors import ConfigError
from sandkernel.gateway.http_api import ApiError

log = logging.getLogger(__name__)

FORWARDED_HEADER = "X-Sandkernel-Forwarded"
# A forwarded create carrying this (and a valid FORWARDED_HEADER) is created where it lands.
PLACE_HERE_HEADER = "X-Sandkernel-Place-Here"
# A signature older (or further ahead, clocks differ) than this is refused: a replay of an old one.
MAX_SKEW_SECONDS = 30.0
MIN_SECRET_BYTES = 32
# Nonces a gateway keeps to refuse a second use: one per forwarded request in the last
# 2 * MAX_SKEW_SECONDS (a few thousand a second is far above what a host forwards). Only a
# request whose signature verified adds one, so only a gateway of the cluster can fill it.
MAX_NONCES = 300_000
EMPTY_BODY_SHA256 = hashlib.sha256(b"").hexdigest()
_HEX = frozenset("0123456789abcdef")


def load_cluster_secret(path: Path) -> bytes:
    """The cluster secret in ``path`` (surrounding whitespace stripped). ConfigError when the
    file is missing or unreadable, readable by anyone but its owner (it must be chmod 600: whoever
    holds it can pose as a gateway), or shorter than :data:`MIN_SECRET_BYTES` bytes."""
    try:
        info = os.stat(path)
        data = Path(path).read_bytes().strip()
    except OSError as err:
        raise ConfigError(f"cannot read the cluster secret file {path}: {err.strerror or err}") from None
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise ConfigError(
            f"the cluster secret file {path} is readable by others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"chmod 600 {path}"
        )
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the cluster secret in {path} is {len(data)} bytes; it needs at least {MIN_SECRET_BYTES} "
            "(e.g. `head -c 48 /dev/urandom | base64 > FILE`)"
        )
    return data


def credential_of(headers: Iterable[tuple[str, str]]) -> str:
    """The request's ``Authorization`` as the receiving gateway reads it (tornado joins
    repeated headers with a comma)."""
    return ",".join(value for name, value in headers if name.lower() == "authorization")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _mac(secret: bytes, method: str, uri: str, stamp: str, origin: str, nonce: str, body: str, credential: str) -> str:
    message = "\n".join((method.upper(), uri, stamp, origin, nonce, body, credential)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(
    secret: bytes,
    method: str,
    uri: str,
    origin: str,
    *,
    body: bytes = b"",
    credential: str = "",
    now: float | None = None,
) -> dict[str, str]:
    """The headers that mark a request to ``uri`` (path and query, as sent) with ``body`` and the
    ``Authorization`` value ``credential`` as forwarded, once, by the gateway of host ``origin``
    at ``now`` (seconds since the epoch; the clock by default)."""
    stamp = str(int(time.time() if now is None else now))
    nonce, body_digest = secrets.token_hex(16), _digest(body)
    sig = _mac(secret, method, uri, stamp, origin, nonce, body_digest, _digest(credential.encode()))
    return {FORWARDED_HEADER: f"host={origin};t={stamp};n={nonce};b={body_digest};sig={sig}"}


@dataclasses.dataclass(frozen=True)
class Forwarded:
    """A verified forwarded request: the host that sent it, and the SHA-256 its body must have."""

    origin: str
    body_sha256: str

    def check_body(self, body: bytes) -> None:
        """ApiError 401 (logged) when ``body`` is not the one the forwarding gateway signed."""
        if not hmac.compare_digest(_digest(body), self.body_sha256):
            raise _refuse(f"the body is not the one {self.origin[:64]!r} signed (altered, or replayed with another)")


class NonceLedger:
    """The nonces of the forwarded requests accepted lately: each is accepted once. A nonce is
    kept for 2 * MAX_SKEW_SECONDS from its first use (past that its signature is stale anyway)."""

    def __init__(self, limit: int = MAX_NONCES, keep_seconds: float = 2 * MAX_SKEW_SECONDS) -> None:
        self._limit, self._keep = limit, keep_seconds
        self._seen: set[str] = set()
        self._order: collections.deque[tuple[float, str]] = collections.deque()

    def __len__(self) -> int:
        return len(self._seen)

    def use(self, nonce: str, now: float | None = None) -> None:
        """Accept ``nonce`` once: ApiError 401 on a second use, 503 when the ledger is full (it
        fails closed: a replay is never let through for want of room)."""
        clock = time.monotonic() if now is None else now
        while self._order and self._order[0][0] <= clock:
            self._seen.discard(self._order.popleft()[1])
        if nonce in self._seen:
            raise _refuse("its nonce was used before (a replayed request)")
        if len(self._seen) >= self._limit:
            log.warning("forwarded-request nonce ledger full (%d); refusing until some expire", self._limit)
            raise ApiError(
                503,
                f"this gateway accepted {self._limit} forwarded requests in the last {self._keep:.0f}s, its most; "
                "retry in a few seconds",
                "busy",
            )
        self._seen.add(nonce)
        self._order.append((clock + self._keep, nonce))


def _refuse(why: str) -> ApiError:
    log.warning("refused a forwarded request: %s", why)
    return ApiError(401, f"bad {FORWARDED_HEADER} header: {why}", "bad_forwarded_signature")


def verify(
    secret: bytes,
    headers: Mapping[str, str],
    method: str,
    uri: str,
    nonces: NonceLedger | None = None,
    now: float | None = None,
) -> Forwarded:
    """The origin host of a request carrying a valid ``X-Sandkernel-Forwarded`` header and the
    SHA-256 its body must have (:meth:`Forwarded.check_body`, once the body is in). ApiError 401 (logged)
    when it is malformed, signed with another secret or for another request or credential, more
    than :data:`MAX_SKEW_SECONDS` away from ``now``, or its nonce is in ``nonces`` already."""
    value = headers.get(FORWARDED_HEADER) or ""
    fields: dict[str, str] = {}
    for part in value.split(";"):
        key, _, field = part.strip().partition("=")
        fields[key] = field
    origin, stamp, sig = fields.get("host", ""), fields.get("t", ""), fields.get("sig", "")
    nonce, body = fields.get("n", ""), fields.get("b", "")
    if not (
        origin
        and stamp.isdigit()
        and len(stamp) < 16
        and sig
        and 16 <= len(nonce) <= 64
        and set(nonce) <= _HEX
        and len(body) == 64
        and set(body) <= _HEX
    ):
        raise _refuse("expected host=<id>;t=<unix time>;n=<nonce>;b=<body sha256>;sig=<hex>")
    credential = _digest((headers.get("Authorization") or "").encode())
    expected = _mac(secret, method, uri, stamp, origin, nonce, body, credential)
    if not hmac.compare_digest(sig.encode(), expected.encode()):
        raise _refuse(
            f"the signature does not match (from {origin[:64]!r}: another cluster secret, or another request, "
            "credential or time than it was signed for)"
        )
    age = (time.time() if now is None else now) - int(stamp)
    if abs(age) > MAX_SKEW_SECONDS:
        raise _refuse(
            f"signed {age:.0f}s from now, more than {MAX_SKEW_SECONDS:.0f}s (a replayed request, or the hosts' clocks "
            "differ: keep them in sync with NTP)"
        )
    if nonces is not None:
        nonces.use(nonce)
    return Forwarded(origin, body)
