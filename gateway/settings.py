"""The gateway's settings: one frozen object, built once, with every default in this module.

``sandkernel serve`` builds a :class:`GatewaySettings` from four sources, highest first:

1. command-line flags (``--pool-size 4``);
2. environment variables (``SANDKERNEL_POOL_SIZE=4``; each field names its variable, shown in
   ``--help``; ``SANDKERNEL_TOKEN``, ``SANDKERNEL_RUNTIME`` and ``SANDKERNEL_NOTEBOOK_DIR`` keep
   the names they always had);
3. a config file (``--config FILE`` or ``$SANDKERNEL_CONFIG``): TOML when the name ends in
   ``.toml`` (read with :mod:`tomllib`, Python 3.11+), JSON otherwise (any Python). Keys are the
   field names below, at the top level (``pool_size = 4``, ``allow_origins = ["https://lab"]``);
   an unknown key is refused with the list of known ones, so a typo never passes silently;
4. the defaults written here, and nowhere else.

``sandkernel serve --help`` is generated from the fields (:func:`add_arguments`): each field's
help text (with its unit), its default and its environment variable.

Shape. Everything here is the **operator's** choice: where the gateway listens, who may call it,
how many sessions and connections it holds, timeouts, the reply budget, and which files hold the
operator's profiles, tokens and egress policy. What a *tenant* may narrow per session (limits,
runtime, network) is decided in one place only, :class:`~sandkernel.kernels.lifecycle.catalog.ProfileCatalog`,
from the profiles file named here; a tenant never reaches these settings.

Why frozen dataclasses and not pydantic-settings: the fields are a flat list of scalars, the
three sources take ~100 lines here, and the project already validates its operator files by hand
with errors that say what to fix; a new dependency (pydantic and its compiled core) in the
gateway's import path was not worth that.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import socket
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sandkernel.errors import ConfigError
from sandkernel.gateway.budget import OutputBudget
from sandkernel.kernels.sandbox.cgroup import DEFAULT_ENGINE_PARENT, check_engine_parent
from sandkernel.kernels.sandbox.exec_stream import FILE_HELPER_TIMEOUT

ENV_PREFIX = "SANDKERNEL_"
CONFIG_ENV = "SANDKERNEL_CONFIG"
RUNTIME_CHOICES = ("auto", "runc", "runsc")
IDLE_ACTIONS = ("pause", "delete")
ON_EXIT_CHOICES = ("keep", "delete")
MEMORY_SNAPSHOT_CHOICES = ("auto", "on", "off")
REPLAY_SIDE_EFFECT_CHOICES = ("allow", "refuse")
BREAKER_ACTIONS = ("quarantine", "restart")
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


def _setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    env: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    zero_is_none: bool = False,
    shown_default: str | None = None,
    positive: bool = False,
    maximum: float | None = None,
    repr: bool = True,
) -> Any:
    """A settings field with what ``--help``, the environment and the config file need to know.

    ``flag`` and ``env`` default to the field's name (``--pool-size``, ``SANDKERNEL_POOL_SIZE``);
    ``zero_is_none`` makes 0 mean "no limit" (None) as the flags always did."""
    metadata = {
        "help": help,
        "flag": flag,
        "env": env,
        "metavar": metavar,
        "choices": choices,
        "zero_is_none": zero_is_none,
        "shown_default": shown_default,
        "positive": positive,
        "maximum": maximum,
    }
    return dataclasses.field(default=default, metadata=metadata, repr=repr)


@dataclasses.dataclass(frozen=True)
class GatewaySettings:
    """What the operator chose for one gateway. Read-only: built once, shared by every handler."""

    # -- where it listens, and who may call it -----------------------------------------------
    ip: str = _setting("127.0.0.1", "address to bind", metavar="ADDRESS")
    port: int = _setting(8888, "port to bind", metavar="PORT")
    certfile: Path | None = _setting(  # noqa: RUF009 (a dataclasses.field)
        None,
        "PEM certificate chain: serve HTTPS and WSS (with --keyfile); in a cluster, advertise https:// URLs so "
        "the hop between gateways is encrypted too",
        metavar="FILE",
    )
    keyfile: Path | None = _setting(  # noqa: RUF009 (a dataclasses.field)
        None, "PEM private key of --certfile (keep it chmod 600)", metavar="FILE"
    )
    token: str | None = _setting(
        None, "auth token of the single tenant", metavar="TOKEN", shown_default="generated and printed", repr=False
    )
    tokens_file: Path | None = _setting(  # noqa: RUF009 (a dataclasses.field)
        None, 'JSON {"tenant": "token"} for several tenants; must be chmod 600', metavar="FILE"
    )
    metrics_token: str | None = _setting(
        None,
        "the operator's token for /metrics (Prometheus sends it as a bearer token; 16+ characters, no tenant's); "
        "without it /metrics answers 403",
        metavar="TOKEN",
        shown_default="none: /metrics is closed",
        repr=False,
    )
    allow_token_in_url: bool = _setting(
        False, "accept ?token= (browser websockets); off by default because URLs end up in logs"
    )
    allow_origins: tuple[str, ...] = _setting(
        (),
        "a browser origin allowed to open kernel websockets, e.g. https://lab.example.com (repeatable; * for any; "
        "comma-separated in the environment)",
        flag="allow-origin",
        metavar="ORIGIN",
    )
    max_connections_per_kernel: int = _setting(16, "websockets per kernel", metavar="N", positive=True)
    header_timeout: float = _setting(
        20.0,
        "seconds a client has to send a request's headers, and may stay idle between requests",
        metavar="S",
        positive=True,
    )
    body_timeout: float = _setting(300.0, "seconds a client has to send a request body", metavar="S", positive=True)

    # -- sessions: the operator's profiles, pool and limits ---------------------------------
    profiles_file: Path | None = _setting(  # noqa: RUF009 (a dataclasses.field)
        None,
        "JSON profiles with their ceilings and operator-owned settings (image, wheelhouse, env): what tenants "
        "may pick and narrow; see docs/security.md",
        flag="profiles",
        metavar="FILE",
        shown_default="the built-in default, small, large",
    )
    default_runtime: str = _setting(
        "auto",
        "runtime of profiles that name none (auto: gVisor where runsc is registered, else runc)",
        env="SANDKERNEL_RUNTIME",
        choices=RUNTIME_CHOICES,
    )
    docker_cgroup_parent: str = _setting(
        DEFAULT_ENGINE_PARENT,
        "the Docker engine's cgroup parent (dockerd's own --cgroup-parent, cgroupfs driver): tenants' CPU groups "
        "are made under it, so sandboxes stay inside what the operator gave the engine",
        metavar="CGROUP",
    )
    egress_policy_file: Path | None = _setting(  # noqa: RUF009 (a dataclasses.field)
        None,
        'JSON allowlist sessions may use or narrow ({"allow": ["pypi.org", ...], ...})',
        flag="egress-policy",
        metavar="FILE",
        shown_default="no network",
    )
    pool_size: int = _setting(
        2, "sandboxes of the default profile kept ready for new sessions (0 disables)", metavar="N"
    )
    pool_max: int = _setting(
        10,
        "the most sandboxes the pool grows to while sessions drain it; it shrinks back to --pool-size once "
        "--pool-demand-window passes without new sessions (never below --pool-size)",
        metavar="N",
    )
    pool_demand_window: float = _setting(
        120.0, "seconds a new session counts as demand the pool sizes itself for", metavar="S", positive=True
    )
    pool_refills: int = _setting(
        0,
        "pooled sandboxes started at once while the pool refills (0: one per CPU core)",
        metavar="N",
        maximum=64,
    )
    pool_preload: tuple[str, ...] = _setting(
        ("numpy", "pandas", "matplotlib.pyplot"),
        "a module pooled kernels import before handout, so a session's first import costs nothing (repeatable; "
        "comma-separated in the environment; empty: none); silent, no cell, no execution count",
        metavar="MODULE",
    )
    start_concurrency: int = _setting(
        0,
        "cold sandbox starts run at once; more wait their turn, first come first served, so in a burst the first "
        "sessions are ready early instead of all at the end (0: four per CPU core, at least 8)",
        metavar="N",
        maximum=1024,
    )
    tenant_start_concurrency: int = _setting(
        0,
        "cold sandbox starts (create, fork, resume) one token may have running at once; its others wait their turn, "
        "so one tenant's burst leaves the CPU to the others' sessions (0: half the CPU cores, at least 1)",
        metavar="N",
        maximum=1024,
    )
    max_sessions: int = _setting(20, "live sessions per token", metavar="N")
    helper_timeout: float = _setting(
        FILE_HELPER_TIMEOUT,
        "seconds a file operation (list, download, upload) may take inside a sandbox before its helper is "
        "killed and the call fails with 504 (a sandbox's code can stop its helpers)",
        metavar="S",
        positive=True,
    )
    max_sessions_total: int = _setting(100, "live sessions in all (the warm pool counts)", metavar="N")
    idle_timeout: float | None = _setting(
        3600.0,
        "pause or delete (--idle-action) sessions idle this long, seconds (0: never)",
        metavar="S",
        zero_is_none=True,
    )
    idle_action: str = _setting(
        "pause",
        "what the idle timeout does: pause (the session's files are kept in a snapshot and its container removed; "
        "its next call resumes it) or delete",
        choices=IDLE_ACTIONS,
    )
    paused_ttl: float | None = _setting(
        7 * 86400.0, "delete sessions paused this long, seconds (0: never)", metavar="S", zero_is_none=True
    )
    pause_timeout: float = _setting(
        600.0,
        "seconds a pause, fork or checkpoint may take to archive a session's files (a sandbox can stop its "
        "archiver); an idle session whose pause takes longer is deleted, and the audit says why",
        metavar="S",
        positive=True,
    )
    checkpoint_every_cell: bool = _setting(
        False,
        "keep the files of each session after each cell (the newest --checkpoints-kept), so a rewind or a fork at a "
        "cell restores them exactly, and with --memory-snapshots on a gVisor session's memory too (no cell re-run); "
        "costs an archive of /workspace and /tmp (and a save of the kernel) after every cell",
    )
    checkpoints_kept: int = _setting(10, "per-cell checkpoints kept per session", metavar="N", positive=True)
    checkpoint_mb_per_minute: int = _setting(
        1024,
        "what each token's per-cell checkpoints may write in any minute, MiB (past it, cells go on without one "
        "until the minute has passed): a burst of cells over large files cannot keep the disk busy",
        metavar="MB",
        positive=True,
    )
    memory_snapshots: str = _setting(
        "auto",
        "on: gVisor sessions without network egress start savable, and a pause, resume or fork keeps their "
        "kernel's memory (restored_by checkpoint, no cell re-run; needs gVisor 20240729+ run through sandkernel's "
        "runsc wrapper: sandkernel doctor) instead of replaying cells; off: replay for every runtime; auto: on "
        "where this host can (said at start), else off",
        choices=MEMORY_SNAPSHOT_CHOICES,
    )
    replay_side_effects: str = _setting(
        "allow",
        "what a replay resume, fork or rewind does with cells that reached beyond the sandbox when they first ran "
        "(the network through the egress proxy, a shell command, a package install): allow (re-run them; the reply "
        "lists each cell's side_effects) or refuse (the call fails with replay_refused and nothing is re-run)",
        choices=REPLAY_SIDE_EFFECT_CHOICES,
    )
    snapshot_quota_mb: int = _setting(
        10240, "disk each token's snapshots may use, MiB (a pause beyond it is refused)", metavar="MB", positive=True
    )
    max_lifetime: float | None = _setting(
        86400.0, "cull sessions this old, seconds (0: never)", metavar="S", zero_is_none=True
    )
    cull_interval: float = _setting(30.0, "seconds between two looks for sessions to cull", metavar="S", positive=True)
    shutdown_grace: float = _setting(
        30.0,
        "on SIGTERM/SIGINT, seconds running executions get to finish before they are cut (their callers get "
        "status detached, ended_by gateway_restart; the code keeps running in the kernel)",
        metavar="S",
        maximum=3600.0,
    )
    on_exit: str = _setting(
        "keep",
        "what SIGTERM/SIGINT does with the sandboxes: keep (they keep running, recorded in the state dir's "
        "catalog, and the next gateway started on the same state dir adopts them) or delete (every container "
        "and its record removed)",
        choices=ON_EXIT_CHOICES,
    )
    state_dir: Path | None = _setting(  # noqa: RUF009 (a dataclasses.field)
        None,
        "where what outlives the process lives: the session catalog (catalog.sqlite3, holding each kernel's "
        "key, 0600) and workspace disks; a gateway adopts the sessions recorded there at start-up",
        metavar="DIR",
        shown_default="/var/lib/sandkernel for root, else ~/.local/state/sandkernel",
    )
    notebook_dir: Path | None = _setting(  # noqa: RUF009 (a dataclasses.field)
        None, "where transcripts go", metavar="DIR", shown_default="~/.local/share/sandkernel/notebooks"
    )
    snapshot_dir: Path | None = _setting(  # noqa: RUF009 (a dataclasses.field)
        None,
        "where paused sessions' snapshots go (0700, with the key that signs them); in a cluster, one directory on "
        "storage every host mounts (NFS) lets a paused session of a host that died resume on another",
        metavar="DIR",
        shown_default="snapshots/ in the state dir",
    )

    # -- many hosts: a cluster of gateways sharing one catalog (docs/scale-out.md) ------------
    catalog_url: str | None = _setting(
        None,
        "postgresql://USER:PASSWORD@HOST/DB of the catalog the gateways of a cluster share (sessions, hosts, "
        "tenants' counts); unset: the single-host SQLite catalog in the state dir",
        metavar="URL",
        shown_default="single host",
        repr=False,
    )
    host_id: str | None = _setting(
        None,
        "this host's name in the cluster (one gateway per Docker engine; its sessions are recorded under it)",
        metavar="NAME",
        shown_default="the machine's host name",
    )
    advertise_url: str | None = _setting(
        None,
        "the URL the other gateways of the cluster reach this one at",
        metavar="URL",
        shown_default="http://<host name>:<port>",
    )
    cluster_secret_file: Path | None = _setting(  # noqa: RUF009 (a dataclasses.field)
        None,
        "file holding the secret the gateways of one cluster share to sign forwarded requests (chmod 600, "
        "at least 32 bytes); required with --catalog-url",
        metavar="FILE",
    )
    heartbeat_seconds: float = _setting(
        5.0, "how often this gateway tells the cluster catalog it is up", metavar="S", positive=True, maximum=300.0
    )
    host_down_after: float = _setting(
        20.0,
        "seconds without a heartbeat after which a host is marked down and its live sessions lost",
        metavar="S",
        positive=True,
        maximum=3600.0,
    )

    # -- production controls: accounting, policy, breakers, audit ---------------------------
    accounting: bool = _setting(
        True, "measure every cell on the host: CPU, peak memory, files written (SHA-256), egress, packages"
    )
    exec_policy_file: Path | None = _setting(  # noqa: RUF009 (a dataclasses.field)
        None,
        "TOML execution policy: a static review of code before it runs, each rule allow / warn / deny "
        "(advisory: the sandbox stays the boundary); see docs/exec-policy.example.toml",
        flag="exec-policy",
        metavar="FILE",
        shown_default="off",
    )
    breaker_ooms: int = _setting(
        3, "OOM kills in a row that quarantine a session (0: never)", metavar="N", maximum=1000
    )
    breaker_timeouts: int = _setting(
        5, "timeouts in a row that quarantine a session (0: never)", metavar="N", maximum=1000
    )
    breaker_action: str = _setting(
        "quarantine",
        "what a tripped session breaker does: quarantine (executes refused until the session is restarted) "
        "or restart (the kernel is restarted and the count starts again)",
        choices=BREAKER_ACTIONS,
    )
    start_failures: int = _setting(
        3,
        "sandbox starts failing in a row (Docker down or too slow) before new sessions are refused at once "
        "with 503 and Retry-After (0: never)",
        metavar="N",
        maximum=1000,
    )
    start_slow_seconds: float = _setting(
        60.0, "a sandbox start slower than this counts as a failure", metavar="S", positive=True
    )
    start_cooldown: float = _setting(
        10.0,
        "seconds new sessions are refused once the start breaker opens, before it tries again",
        metavar="S",
        positive=True,
        maximum=3600.0,
    )
    audit: bool = _setting(True, "write the audit stream: one tamper-evident JSON line per change of state")
    audit_dir: Path | None = _setting(  # noqa: RUF009 (a dataclasses.field)
        None, "where the audit stream goes (audit.jsonl, rotated)", metavar="DIR", shown_default="<state dir>/audit"
    )
    audit_code: bool = _setting(True, "keep the code itself in audit records (its SHA-256 is always kept)")
    audit_max_bytes: int = _setting(
        64 * 1024 * 1024, "size at which the audit file is rotated (also once a day)", metavar="BYTES", positive=True
    )
    audit_keep_days: float = _setting(
        7.0,
        "days a rotated audit file is kept after its last record; older ones are deleted, younger ones never "
        "(not even for room: see --audit-max-mb)",
        metavar="DAYS",
        positive=True,
    )
    audit_max_mb: int = _setting(
        4096,
        "disk budget of the audit directory, MiB; must hold --audit-keep-days of records (an execution's is about "
        "1 KiB plus up to 4 KiB of its code). "
        "Full of records younger than that, it deletes nothing: the tenants holding the most of it have their "
        "executions refused until files age out",
        metavar="MB",
        positive=True,
    )
    audit_tenant_mb_per_minute: int = _setting(
        16,
        "audit records each tenant's activity may write in any minute, MiB; past it, that tenant's executions are "
        "refused until the minute has passed, so one tenant's burst cannot crowd the others out of the audit history",
        metavar="MB",
        positive=True,
    )

    # -- what one execute reply may carry (see gateway/budget.py) ---------------------------
    output_budget: int = _setting(64 * 1024, "bytes of text per execute reply", metavar="BYTES")
    max_images: int = _setting(8, "images per execute reply", metavar="N")
    max_image_bytes: int = _setting(
        2 * 1024 * 1024, "bytes of one image (base64) in an execute reply; larger ones are summarised", metavar="BYTES"
    )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = _coerce(field.name, getattr(self, field.name))
            _check(field.name, value)
            object.__setattr__(self, field.name, value)
        _check_tls(self)
        _check_cluster(self)

    @property
    def cluster(self) -> bool:
        """Whether this gateway is one host of a cluster (a shared PostgreSQL catalog)."""
        return self.catalog_url is not None

    @property
    def cluster_host_id(self) -> str:
        """This host's name in the cluster: ``host_id``, or the machine's host name."""
        return self.host_id or socket.gethostname()

    @property
    def scheme(self) -> str:
        """``https`` when the gateway serves TLS (--certfile), else ``http``."""
        return "https" if self.certfile is not None else "http"

    @property
    def cluster_url(self) -> str:
        """Where the other gateways reach this one: ``advertise_url``, or this host's name and port."""
        return (self.advertise_url or f"{self.scheme}://{socket.gethostname()}:{self.port}").rstrip("/")

    @property
    def pool_ceiling(self) -> int:
        """The most sandboxes the warm pool holds: ``pool_max``, but never below ``pool_size``."""
        return max(self.pool_size, self.pool_max)

    @property
    def pool_refill_concurrency(self) -> int:
        """Pooled sandboxes started at once: ``pool_refills``, or one per CPU core (a start is
        mostly CPU work in dockerd, runc and the kernel's imports, so more than the cores only
        queues there, and takes them from live sessions)."""
        return self.pool_refills or max(1, os.cpu_count() or 1)

    @property
    def cold_start_concurrency(self) -> int:
        """Cold starts run at once: ``start_concurrency``, or four per CPU core and at least 8.
        A start is mostly CPU work (dockerd, runc, the kernel's imports) with waits on the engine
        in between: fewer than that left the cores idle in a burst (measured on 2 cores: 4 at
        once made a burst of 50 take 1.6x as long), many more only shares the cores so that
        every start of the burst ends at its end."""
        return self.start_concurrency or max(8, 4 * (os.cpu_count() or 1))

    @property
    def tenant_cold_start_concurrency(self) -> int:
        """One tenant's cold starts at once: ``tenant_start_concurrency``, or half the CPU cores
        and at least 1. A start is mostly CPU work outside the tenant's own sandboxes (dockerd,
        runc, the engine's mounts), which the tenants' CPU groups do not share out: measured with
        bench/noisy_neighbour.py on 2 cores, one at a time took another tenant's execute under a
        tenant forking at its limit from 1.96x to 1.39x its p50 alone (7.4x to 2.3x its p99)."""
        return self.tenant_start_concurrency or max(1, (os.cpu_count() or 1) // 2)

    @property
    def budget(self) -> OutputBudget:
        """What one execute reply may carry (the same for streamed and whole replies)."""
        return OutputBudget(self.output_budget, self.max_images, self.max_image_bytes)

    def replace(self, **changes: Any) -> GatewaySettings:
        """A copy with ``changes`` (validated like any settings)."""
        return dataclasses.replace(self, **changes)

    # -- building from the sources -----------------------------------------------------------

    @classmethod
    def from_sources(
        cls,
        flags: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        config_file: str | Path | None = None,
    ) -> GatewaySettings:
        """Flags > environment > config file > defaults. ``flags`` maps field names to values
        already typed (what :func:`add_arguments`'s flags parse to); ``environ`` defaults to
        ``os.environ`` (read now, not at import). Raises :class:`ConfigError` naming the source."""
        environ = os.environ if environ is None else environ
        config_file = config_file or environ.get(CONFIG_ENV) or None
        values: dict[str, Any] = {}
        if config_file:
            for name, raw in _read_config_file(Path(config_file)).items():
                values[name] = _from_file(name, raw, f"{config_file}: {name}")
        for field in dataclasses.fields(cls):
            variable = env_name(field)
            if variable in environ:
                values[field.name] = _from_text(field.name, environ[variable], f"${variable}")
        for name, value in (flags or {}).items():
            values[name] = _from_flag(name, value)
        return cls(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> GatewaySettings:
        """From a namespace parsed with :func:`add_arguments` (only the flags given are in it)."""
        names = {field.name for field in dataclasses.fields(cls)}
        flags = {name: value for name, value in vars(args).items() if name in names}
        return cls.from_sources(flags, environ, getattr(args, "config", None))


# -- the field table ------------------------------------------------------------------------


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(GatewaySettings)


def env_name(field: dataclasses.Field) -> str:
    return field.metadata.get("env") or ENV_PREFIX + field.name.upper()


def flag_name(field: dataclasses.Field) -> str:
    return "--" + (field.metadata.get("flag") or field.name.replace("_", "-"))


def _kind(name: str) -> type:
    """The scalar type of a field: bool, int, float, str, Path or tuple (of str)."""
    hint = _hints()[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = typing.get_origin(hint) or hint
    if base is tuple:
        return tuple
    if args and typing.get_origin(hint) is not tuple:
        return typing.get_origin(args[0]) or args[0]
    return base


def _optional(name: str) -> bool:
    return type(None) in typing.get_args(_hints()[name])


def _coerce(name: str, value: Any) -> Any:
    """The forms Python callers naturally pass: a str for a path, a list for a tuple, an int
    for a float."""
    kind = _kind(name)
    if kind is Path and isinstance(value, str):
        return Path(value)
    if kind is tuple and isinstance(value, list):
        return tuple(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _check(name: str, value: Any) -> None:
    """Type and range of one field's value; ConfigError says which and why."""
    kind = _kind(name)
    if value is None:
        if not _optional(name):
            raise ConfigError(f"setting {name} may not be empty")
        return
    if kind is tuple:
        ok = isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    else:
        ok = isinstance(value, kind)
    if not ok or (kind in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"setting {name} must be a {_kind_words(kind)}, not {value!r}")
    if kind in (int, float) and value < 0:
        raise ConfigError(f"setting {name} must not be negative, not {value!r}")
    if kind in (int, float) and value == 0 and _field(name).metadata.get("positive"):
        raise ConfigError(f"setting {name} must be more than 0")
    maximum = _field(name).metadata.get("maximum")
    if kind in (int, float) and maximum is not None and value > maximum:
        raise ConfigError(f"setting {name} must be at most {maximum:g}, not {value!r}")
    if name == "port" and value > 65535:
        raise ConfigError(f"setting port must be 0..65535, not {value}")
    choices = _field(name).metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"setting {name} must be one of {', '.join(choices)}, not {value!r}")
    if name == "docker_cgroup_parent":
        try:
            check_engine_parent(value)
        except ValueError as err:
            raise ConfigError(f"setting {name}: {err}") from None


HOST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def _check_tls(settings: GatewaySettings) -> None:
    if (settings.certfile is None) != (settings.keyfile is None):
        raise ConfigError("HTTPS needs both --certfile and --keyfile (the certificate chain and its private key)")


def _check_cluster(settings: GatewaySettings) -> None:
    """The cluster settings belong together; the catalog URL (which may hold a password) is never
    echoed in a message."""
    if settings.host_id is not None and not HOST_ID.fullmatch(settings.host_id):
        raise ConfigError(
            "setting host_id must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    if settings.advertise_url is not None and not settings.advertise_url.startswith(("http://", "https://")):
        raise ConfigError("setting advertise_url must start with http:// or https://")
    if settings.catalog_url is None:
        return
    if not settings.catalog_url.startswith(("postgresql://", "postgres://")):
        raise ConfigError("setting catalog_url must be a postgresql:// URL (the cluster's shared PostgreSQL catalog)")
    if settings.cluster_secret_file is None:
        raise ConfigError(
            "a cluster catalog (--catalog-url) needs --cluster-secret-file: the secret the gateways share to "
            "sign forwarded requests (the same file on every host, chmod 600, at least 32 bytes)"
        )


def _kind_words(kind: type) -> str:
    return {
        bool: "boolean",
        int: "whole number",
        float: "number",
        str: "string",
        Path: "path",
        tuple: "list of strings",
    }[kind]


def _field(name: str) -> dataclasses.Field:
    for field in dataclasses.fields(GatewaySettings):
        if field.name == name:
            return field
    raise ConfigError(f"unknown setting {name!r}")


def _finish(name: str, value: Any) -> Any:
    """0 means "never" for the fields that say so; numbers are floats where the field is."""
    if _field(name).metadata.get("zero_is_none") and value == 0:
        return None
    if _kind(name) is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _from_flag(name: str, value: Any) -> Any:
    if _kind(name) is tuple:
        return tuple(value)
    if _kind(name) is Path and value is not None:
        return Path(value)
    return _finish(name, value)


def _from_text(name: str, raw: str, where: str) -> Any:
    """A value from an environment variable (a string)."""
    kind = _kind(name)
    text = raw.strip()
    if kind is bool:
        if text.lower() not in TRUE_WORDS | FALSE_WORDS:
            raise ConfigError(f"{where} must be true or false (1/0, yes/no), not {raw!r}")
        return text.lower() in TRUE_WORDS
    if kind is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if not text and _optional(name):
        return None
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(f"{where} must be a {_kind_words(kind)}, not {raw!r}") from None
    return _finish(name, value)


def _from_file(name: str, raw: Any, where: str) -> Any:
    """A value from the config file (already JSON/TOML-typed)."""
    kind = _kind(name)
    if raw is None and (_optional(name) or _field(name).metadata.get("zero_is_none")):
        return None
    if kind is tuple:
        if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
            raise ConfigError(f"{where} must be a list of strings, not {raw!r}")
        return tuple(raw)
    if kind is Path:
        if not isinstance(raw, str) or not raw:
            raise ConfigError(f"{where} must be a file path string, not {raw!r}")
        return Path(raw)
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        raw = float(raw)
    if not isinstance(raw, kind) or (kind in (int, float) and isinstance(raw, bool)):
        raise ConfigError(f"{where} must be a {_kind_words(kind)}, not {raw!r}")
    return _finish(name, raw)


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read the config file {path}: {err}") from err
    if path.suffix == ".toml":
        if sys.version_info < (3, 11):
            raise ConfigError(f"config file {path}: TOML needs Python 3.11+; write it as JSON instead")
        import tomllib

        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {path} is not valid TOML: {err}") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as err:
            raise ConfigError(f"config file {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold an object of settings (setting name -> value)")
    known = {field.name for field in dataclasses.fields(GatewaySettings)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"config file {path}: unknown settings {unknown}; known: {', '.join(sorted(known))}")
    return data


# -- the command line ------------------------------------------------------------------------


def shown_default(field: dataclasses.Field) -> str:
    shown = field.metadata.get("shown_default")
    if shown is not None:
        return shown
    default = field.default
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, tuple):
        return "none" if not default else ", ".join(default)
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return "none" if default is None else str(default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per settings field (and ``--config``), help generated from the fields.

    Flags default to "not given" (absent from the namespace), so :meth:`GatewaySettings.from_args`
    can let the environment and the config file fill what the command line leaves out."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"settings file, TOML (*.toml) or JSON; keys are the settings' names (${CONFIG_ENV}); "
        "precedence: flags > environment > file > defaults",
    )
    for field in dataclasses.fields(GatewaySettings):
        kind = _kind(field.name)
        text = f"{field.metadata['help']} (default: {shown_default(field)}; ${env_name(field)})"
        options: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS, "help": text}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["metavar"] = field.metadata.get("metavar")
            if kind is tuple:
                options["action"] = "append"
            elif kind in (int, float):
                options["type"] = kind
            if field.metadata.get("choices"):
                options["choices"] = field.metadata["choices"]
                options.pop("metavar")
        parser.add_argument(flag_name(field), **options)
