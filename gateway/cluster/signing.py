"""Signed requests between the gateways of a cluster: the ``X-Sandkernel-Forwarded`` header.

A gateway that forwards a tenant's request to the host holding the session adds one header,
``X-Sandkernel-Forwarded: host=<origin host id>;t=<unix seconds>;sig=<hex>``, where ``sig`` is
HMAC-SHA256 over ``METHOD \\n path?query \\n t \\n origin`` with the secret every gateway of the
cluster shares (``--cluster-secret-file``). The tenant's own ``Authorization`` travels beside it:
the owner authenticates the tenant itself, so the signature grants nothing a tenant lacks. What
it does say is "a gateway of this cluster sent this, now": the receiver serves such a request
itself and never forwards it again (the loop guard), and a create carrying it (with
``X-Sandkernel-Place-Here``) is placed where it lands. A header that does not verify (another
secret, another method or URL, more than :data:`MAX_SKEW_SECONDS` old or ahead: a replay of an
old one) is a 401 with a sentence saying which, and is logged; the comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path

from sandkernel.errors import ConfigError
from sandkernel.gateway.base import ApiError

log = logging.getLogger(__name__)

FORWARDED_HEADER = "X-Sandkernel-Forwarded"
# A forwarded create carrying this (and a valid FORWARDED_HEADER) is created where it lands.
PLACE_HERE_HEADER = "X-Sandkernel-Place-Here"
# A signature older (or further ahead, clocks differ) than this is refused: a replay of an old one.
MAX_SKEW_SECONDS = 30.0
MIN_SECRET_BYTES = 32


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


def _mac(secret: bytes, method: str, uri: str, stamp: str, origin: str) -> str:
    message = "\n".join((method.upper(), uri, stamp, origin)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, uri: str, origin: str, now: float | None = None) -> dict[str, str]:
    """The headers that mark a request to ``uri`` (path and query, as sent) as forwarded by the
    gateway of host ``origin``, at ``now`` (seconds since the epoch; the clock by default)."""
    stamp = str(int(time.time() if now is None else now))
    return {FORWARDED_HEADER: f"host={origin};t={stamp};sig={_mac(secret, method, uri, stamp, origin)}"}


def _refuse(why: str) -> ApiError:
    log.warning("refused a forwarded request: %s", why)
    return ApiError(401, f"bad {FORWARDED_HEADER} header: {why}", "bad_forwarded_signature")


def verify(secret: bytes, headers: Mapping[str, str], method: str, uri: str, now: float | None = None) -> str:
    """The origin host of a request carrying a valid ``X-Sandkernel-Forwarded`` header. ApiError
    401 (logged) when it is malformed, signed with another secret or for another request, or more
    than :data:`MAX_SKEW_SECONDS` away from ``now``."""
    value = headers.get(FORWARDED_HEADER) or ""
    fields: dict[str, str] = {}
    for part in value.split(";"):
        key, _, field = part.strip().partition("=")
        fields[key] = field
    origin, stamp, sig = fields.get("host", ""), fields.get("t", ""), fields.get("sig", "")
    if not (origin and stamp.isdigit() and len(stamp) < 16 and sig):
        raise _refuse("expected host=<id>;t=<unix time>;sig=<hex>")
    if not hmac.compare_digest(sig.encode(), _mac(secret, method, uri, stamp, origin).encode()):
        raise _refuse(f"the signature does not match (from {origin[:64]!r}: another cluster secret, or altered)")
    age = (time.time() if now is None else now) - int(stamp)
    if abs(age) > MAX_SKEW_SECONDS:
        raise _refuse(
            f"signed {age:.0f}s from now, more than {MAX_SKEW_SECONDS:.0f}s (a replayed request, or the hosts' clocks "
            "differ: keep them in sync with NTP)"
        )
    return origin
