"""A throwaway PostgreSQL server for the cluster tests, from Debian's own binaries.

``postgres_url`` (session scope) starts one server for the whole run: a fresh cluster made by
``initdb`` in a temporary directory, run as the unprivileged ``postgres`` OS user when the tests
run as root (PostgreSQL refuses to run as root), listening only on 127.0.0.1 at a free port and
on a unix socket inside that directory, with scram-sha-256 password authentication for a
generated password. It yields a ``postgresql://`` URL of a database made for the run, and at the
end stops the server, checks that its postmaster is gone, and removes the directory.

``fresh_postgres_url`` (function scope) gives each test its own empty database on that server
(``CREATE DATABASE`` with a random name, dropped after the test with ``WITH (FORCE)``, which also
ends any connection the test left open): tests never see each other's rows.

Use them from a test module with ``from .postgres_fixtures import fresh_postgres_url, postgres_url``
(pytest finds fixtures imported into the module); ``create_database``/``drop_database`` are there
for a test that needs several databases. Durability settings (fsync, synchronous_commit) are off:
this server holds nothing worth a disk flush, and the tests are quicker for it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PG_VERSION = "15"  # Debian 12's; scripts/host-setup.sh installs it
PG_BIN = Path(f"/usr/lib/postgresql/{PG_VERSION}/bin")
SUPERUSER = "sandkernel"
START_ATTEMPTS = 3  # a free port can be taken between choosing it and the server binding it


@dataclass(frozen=True)
class PostgresServer:
    """One running throwaway server: where it listens and how to log in as its superuser."""

    host: str
    port: int
    user: str
    password: str
    socket_dir: Path
    data_dir: Path

    def url(self, database: str = "postgres") -> str:
        """A ``postgresql://`` URL for ``database`` with the password in it (quoted)."""
        password = urllib.parse.quote(self.password, safe="")
        return f"postgresql://{self.user}:{password}@{self.host}:{self.port}/{database}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as() -> tuple[dict[str, object], int | None]:
    """subprocess keyword arguments that drop to ``postgres`` when we are root, and its uid."""
    if os.geteuid() != 0:
        return {}, None
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        pytest.fail(
            "the tests run as root and there is no 'postgres' OS user to run PostgreSQL as "
            "(install Debian's postgresql package: scripts/host-setup.sh)"
        )
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}, entry.pw_uid


def _pg(tool: str, *args: str, as_user: dict[str, object], log: Path | None = None) -> None:
    """Run one of PostgreSQL's programs; a failure fails the test with its output (and the log)."""
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C", "LANG": "C", "TZ": "UTC"}
    result = subprocess.run(
        [str(PG_BIN / tool), *args], env=env, cwd="/", capture_output=True, text=True, timeout=60, **as_user
    )
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
        raise RuntimeError(
            f"{tool} {' '.join(args)} failed ({result.returncode}):\n{result.stdout}{result.stderr}{tail}"
        )


def _postmaster_pid(data_dir: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((data_dir / "postmaster.pid").read_text().splitlines()[0])
    return None


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (the postmaster is reparented to PID 1 when
    ``pg_ctl start`` exits, and PID 1 here may reap it late: a zombie holds no port or files)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@contextlib.contextmanager
def running_postgres(also_on: tuple[str, str] | None = None) -> Iterator[PostgresServer]:
    """Start a throwaway server (see the module docstring); stop it and remove its files after.

    ``also_on``: (address, client network), e.g. ``("10.213.0.254", "10.213.0.0/24")``, for the
    swarm lab's hosts: the server listens on that address too and takes password logins from that
    network only. The returned server's ``host`` is then that address."""
    if not (PG_BIN / "initdb").exists():
        pytest.fail(f"PostgreSQL {PG_VERSION} is not installed ({PG_BIN}/initdb is missing): run scripts/host-setup.sh")
    as_user, uid = _run_as()
    root = Path(tempfile.mkdtemp(prefix="sk-pg-"))
    data_dir, socket_dir, log = root / "data", root / "sock", root / "postgres.log"
    password = secrets.token_urlsafe(24)
    started = False
    try:
        socket_dir.mkdir(mode=0o700)
        pwfile = root / "pwfile"
        pwfile.write_text(password + "\n")
        pwfile.chmod(0o600)
        if uid is not None:
            for path in (root, socket_dir, pwfile):
                os.chown(path, uid, -1)
        _pg(
            "initdb",
            "-D",
            str(data_dir),
            "-U",
            SUPERUSER,
            f"--pwfile={pwfile}",
            "--auth=scram-sha-256",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
            as_user=as_user,
        )
        pwfile.unlink()
        # Loopback TCP and our own socket (and the lab network when asked); every login needs the password.
        hba = "local all all scram-sha-256\nhost all all 127.0.0.1/32 scram-sha-256\n"
        listen = "127.0.0.1"
        if also_on is not None:
            hba += f"host all all {also_on[1]} scram-sha-256\n"
            listen += f",{also_on[0]}"
        (data_dir / "pg_hba.conf").write_text(hba)
        for attempt in range(START_ATTEMPTS):
            port = _free_port()
            with (data_dir / "postgresql.auto.conf").open("w") as conf:
                conf.write(
                    f"listen_addresses = '{listen}'\nport = {port}\nunix_socket_directories = '{socket_dir}'\n"
                    "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 200\n"
                    "password_encryption = 'scram-sha-256'\n"
                )
            try:
                _pg("pg_ctl", "-D", str(data_dir), "-l", str(log), "-w", "-t", "30", "start", as_user=as_user, log=log)
                started = True
                break
            except RuntimeError:
                if attempt == START_ATTEMPTS - 1:
                    raise
        yield PostgresServer(also_on[0] if also_on else "127.0.0.1", port, SUPERUSER, password, socket_dir, data_dir)
    finally:
        try:
            if started:
                _stop(data_dir, as_user, log)
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _stop(data_dir: Path, as_user: dict[str, object], log: Path) -> None:
    """Stop our postmaster: SIGINT (PostgreSQL's "fast" shutdown: ends its sessions and its
    children, then exits), watched by its pid every 20 ms (``pg_ctl stop -w`` polls by the
    second); SIGKILL, by the same pid, if it has not gone within 20 s."""
    pid = _postmaster_pid(data_dir)
    if pid is None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            _pg("pg_ctl", "-D", str(data_dir), "-m", "fast", "-w", "-t", "20", "stop", as_user=as_user, log=log)
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        raise RuntimeError(f"the test PostgreSQL (pid {pid}) did not stop on SIGINT within 20 s; it was killed")


def create_database(server_url: str) -> str:
    """Create an empty database with a random name on the server of ``server_url``; its URL."""
    import psycopg

    name = f"sk_test_{secrets.token_hex(6)}"
    with psycopg.connect(server_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return _with_database(server_url, name)


def drop_database(database_url: str) -> None:
    """Drop the database of ``database_url`` and end every connection still open to it."""
    import psycopg

    name = urllib.parse.urlsplit(database_url).path.lstrip("/")
    with psycopg.connect(_with_database(database_url, "postgres"), autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _with_database(url: str, name: str) -> str:
    return urllib.parse.urlsplit(url)._replace(path=f"/{name}").geturl()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The run's throwaway server (for tests that need its parts: port, password, socket dir)."""
    with running_postgres() as server:
        pid = _postmaster_pid(server.data_dir)
        yield server
    assert pid is not None and not _alive(pid), f"the test PostgreSQL (pid {pid}) is still running"
    with socket.socket() as probe:
        assert probe.connect_ex((server.host, server.port)) != 0, f"something still listens on port {server.port}"


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A ``postgresql://`` URL (password included) of a database made for this run."""
    url = create_database(postgres_server.url())
    yield url
    drop_database(url)


@pytest.fixture
def fresh_postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A ``postgresql://`` URL of an empty database of this test's own, dropped after it."""
    url = create_database(postgres_server.url())
    yield url
    drop_database(url)
