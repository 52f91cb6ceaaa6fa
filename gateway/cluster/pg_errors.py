"""How the PostgreSQL session catalog names itself in errors, and the errors it raises.

Shared by :mod:`.postgres` (the store), :mod:`.pg_host_lock` and :mod:`.pg_schema`, so each of
them names the catalog the same way: ``postgresql://user@host:port/db``, never the password.
Every message has the password scrubbed out of whatever libpq said (:meth:`CatalogAddress.scrub`),
and callers raise these ``from None`` so a logged traceback carries no raw driver message either.
A psycopg error becomes ours in one place, :func:`catalog_error`: the connection-level ones
(``OperationalError``) are :class:`CatalogUnavailableError` (503, try again), the rest
:class:`StoreError`.
"""

from __future__ import annotations

import urllib.parse

from sandkernel.kernels.durable.store import StoreError

try:  # the `cluster` extra; PostgresStore.open refuses before anything here runs without it
    import psycopg
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]


class CatalogUnavailableError(StoreError):
    """PostgreSQL cannot be reached (down, unreachable, refusing this gateway's login): the
    request that needed the catalog fails now; try again later."""

    status = 503


class HostIdInUseError(StoreError):
    """Another gateway holds this host id in the shared catalog: two gateways on one host id would
    claim, adopt and reap the same sessions. At start-up nothing was done; later (the lock was lost
    and another gateway took it) this store refuses every call until the gateway is restarted."""

    status = 503
    code = "host_id_in_use"


class CatalogAddress:
    """A ``postgresql://`` URL, and how to name it in an error without its password."""

    def __init__(self, url: str) -> None:
        if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("postgresql", "postgres"):
            raise StoreError("the catalog URL must be a postgresql://user:password@host:port/database URL")
        self.url = url
        self._secrets = _password_forms(url)
        parts = urllib.parse.urlsplit(url)
        try:
            host, port = parts.hostname or "localhost", parts.port or 5432
        except ValueError:
            raise StoreError(f"the catalog URL {self.scrub(url)!r} has an invalid port") from None
        user = f"{urllib.parse.unquote(parts.username)}@" if parts.username else ""
        self.display = f"postgresql://{user}{host}:{port}{parts.path or '/'}"

    def scrub(self, text: str) -> str:
        """``text`` with every form of the password replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def __repr__(self) -> str:
        return f"CatalogAddress({self.display!r})"


def _password_forms(url: str) -> list[str]:
    """The password of ``url`` (in the user part or as ``?password=``) as written, decoded and
    encoded: every form an error message could quote."""
    parts = urllib.parse.urlsplit(url)
    found: list[str] = []
    with_user = parts.netloc.rpartition("@")[0]
    if ":" in with_user:
        found.append(with_user.partition(":")[2])
    for pair in parts.query.split("&"):
        key, _, value = pair.partition("=")
        if urllib.parse.unquote_plus(key) == "password":
            found.append(value)
    forms = {
        form
        for raw in found
        for form in (raw, urllib.parse.unquote(raw), urllib.parse.unquote_plus(raw), urllib.parse.quote(raw, safe=""))
        if form
    }
    return sorted(forms, key=len, reverse=True)  # longest first: a form inside another is replaced after it


def catalog_error(address: CatalogAddress, err: Exception, failed: str, *, opening: bool = False) -> StoreError:
    """The psycopg error ``err`` as ours, for ``raise ... from None``: ``"<failed>: <what libpq
    said, the password scrubbed>"``. A ``psycopg.OperationalError`` (the server is down or
    unreachable, refused the login, or the connection broke) is :class:`CatalogUnavailableError`;
    with ``opening`` (while a gateway opens the catalog) it says what to check instead
    (:func:`unreachable`). Any other error (a refused statement) is :class:`StoreError`.
    ``failed`` names the step and the catalog: ``"writing the session catalog postgresql://… failed"``."""
    if isinstance(err, psycopg.OperationalError):
        return unreachable(address, err) if opening else CatalogUnavailableError(f"{failed}: {_why(address, err)}")
    return StoreError(f"{failed}: {_why(address, err)}")


def unreachable(address: CatalogAddress, err: Exception) -> CatalogUnavailableError:
    """The error of an open that could not reach PostgreSQL (or was refused), with what to check."""
    return CatalogUnavailableError(
        f"cannot open the session catalog {address.display}: {_why(address, err)}. Check --catalog-url (host, port, "
        "database, user and password), that PostgreSQL is running and reachable from this host, and that its "
        "pg_hba.conf lets this user in"
    )


def _why(address: CatalogAddress, err: Exception) -> str:
    """What the driver said, without the password (its type when it said nothing)."""
    return address.scrub(str(err)).strip() or type(err).__name__
