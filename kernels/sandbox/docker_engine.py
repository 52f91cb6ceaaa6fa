"""Async access to the Docker engine, with its errors translated into sandkernel's.

The Docker SDK is blocking, so every call runs in a worker thread: one slow
``containers.list()`` must never stall the gateway's event loop. The engine has its own threads
(:data:`DOCKER_WORKER_THREADS`), apart from the loop's default executor: Docker work that a
sandbox holds up (a helper it stopped waits for its deadline) never delays the gateway's other
blocking work (transcript writes, accounting walks, snapshot files). Other modules use
:class:`DockerEngine` and catch ``docker.errors`` only where they translate them.

dockerd restarts (issue 13): with ``live-restore`` (scripts/host-setup.sh) the sandboxes keep
running while dockerd is away, and their kernels keep answering over ZMQ, which needs no
dockerd. What does need it fails meanwhile with :class:`DockerUnavailableError` (503, "retry"):
the SDK raises ``requests`` connection errors there, not ``docker.errors``, so they are
translated here. Nothing has to reconnect by hand: the SDK's connection pool (urllib3) checks a
pooled connection before reusing it and opens a new one to the socket when dockerd closed it.
A call already on a connection when dockerd went away breaks; a read (inspect, list, info) is
sent once more on a fresh connection, anything that changes state is not (it may have happened).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions
import urllib3.exceptions

from sandkernel.errors import (
    DockerUnavailableError,
    ImageNotFoundError,
    KernelStartError,
    RuntimeUnavailableError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

DOCKER_HINT = "start it with `bash scripts/host-setup.sh` (as root) or `dockerd &`, then retry"

# What the SDK raises when the engine's socket is gone, refuses, or drops a call (a restart).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    requests.exceptions.ConnectionError,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.ProtocolError,
)
# Calls that only read, by name (SDK methods and this module's own): sent again once when the
# connection broke under them, since sending a read twice changes nothing.
IDEMPOTENT_READS = frozenset(
    {
        "inspect_container",
        "exec_inspect",
        "containers",
        "info",
        "ping",
        "version",
        "inspect_image",
        "images",
        "runtimes_sync",
        "image_id_sync",
        "cgroup_driver_sync",
    }
)


# Threads of one engine's Docker calls (and of the SDK's connection pool): a sandbox holds at
# most a few of them (container.HELPERS_PER_LANE per lane), each until its helper's deadline.
DOCKER_WORKER_THREADS = 32


class DockerEngine:
    """One Docker client shared by a process, used from its own worker threads."""

    def __init__(self, client: docker.DockerClient | None = None) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._cgroup_driver: str | None = None
        self._executor = ThreadPoolExecutor(DOCKER_WORKER_THREADS, thread_name_prefix="sandkernel-docker")

    @property
    def client(self) -> docker.DockerClient:
        """The SDK client, created on first use (blocking: call from a worker thread)."""
        with self._lock:
            if self._client is None:
                try:
                    self._client = docker.from_env(timeout=120, max_pool_size=DOCKER_WORKER_THREADS)
                    self._client.ping()
                except (docker.errors.DockerException, *CONNECTION_ERRORS) as err:
                    self._client = None
                    raise DockerUnavailableError(f"cannot reach the Docker engine ({err}); {DOCKER_HINT}") from err
            return self._client

    async def run(self, func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking SDK call in a worker thread, translating connection errors into
        :class:`DockerUnavailableError` (``docker.errors.APIError`` passes through: callers
        translate those with what they know); a read is retried once on a broken connection."""
        work = functools.partial(contextvars.copy_context().run, self.call_sync, func, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    def call_sync(self, func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """:meth:`run`'s work, in the calling thread (for code that is already in a worker)."""
        name = getattr(func, "__name__", "")
        attempts = 2 if name in IDEMPOTENT_READS else 1
        for attempt in range(1, attempts + 1):
            try:
                return func(*args, **kwargs)
            except docker.errors.APIError:
                raise
            except CONNECTION_ERRORS as err:
                if attempt < attempts:
                    log.info("the Docker connection broke during %s (%s); sending it again", name, err)
                    continue
                raise DockerUnavailableError(
                    f"the Docker engine is not answering ({err}); it may be restarting: retry in a few seconds, "
                    f"or {DOCKER_HINT}"
                ) from err
            except requests.exceptions.Timeout as err:
                raise DockerUnavailableError(f"the Docker engine did not answer in time ({err}); retry") from err
            except docker.errors.DockerException as err:
                raise DockerUnavailableError(f"Docker engine error ({err}); {DOCKER_HINT}") from err
        raise AssertionError("unreachable")

    # -- checks made before anything is created, so bad input leaves nothing behind ---------

    def cgroup_driver_sync(self) -> str:
        """The engine's cgroup driver (``cgroupfs`` or ``systemd``); read once: it changes only
        with a restart of dockerd, which keeps its configuration."""
        if self._cgroup_driver is None:
            self._cgroup_driver = str(self.client.info().get("CgroupDriver") or "")
        return self._cgroup_driver

    def runtimes_sync(self) -> set[str]:
        """Names of the OCI runtimes registered with the engine."""
        return set(self.client.info().get("Runtimes", {}))

    async def require_runtime(self, runtime: str) -> None:
        """Fail closed when a runtime is not registered: never fall back to another."""
        runtimes = await self.run(self.runtimes_sync)
        if runtime not in runtimes:
            fix = (
                "install gVisor (`apt-get install runsc`) and register it with `bash scripts/host-setup.sh`"
                if runtime == "runsc"
                else "register it in /etc/docker/daemon.json"
            )
            raise RuntimeUnavailableError(
                f"container runtime {runtime!r} is not registered with Docker (have: {sorted(runtimes)}); "
                f"{fix}. sandkernel does not fall back to another runtime."
            )

    def image_id_sync(self, image: str) -> str:
        """The local image's id; raises :class:`ImageNotFoundError` with the build command."""
        try:
            return self.client.images.get(image).id
        except docker.errors.ImageNotFound:
            raise ImageNotFoundError(
                f"kernel image {image!r} is not on this machine; build it with `sandkernel image build` "
                "(or set the profile's image to one that exists)"
            ) from None
        except docker.errors.APIError as err:
            raise ImageNotFoundError(f"kernel image {image!r} cannot be used: {err.explanation}") from err

    async def image_id(self, image: str) -> str:
        return await self.run(self.image_id_sync, image)


def translate_api_error(err: docker.errors.APIError, what: str) -> Exception:
    """Turn a Docker API error into the sandkernel error a caller can act on."""
    text = str(err.explanation or err)
    if "runtime" in text and ("unknown" in text or "invalid" in text):
        return RuntimeUnavailableError(f"{what}: {text}; register the runtime with `bash scripts/host-setup.sh`")
    if isinstance(err, docker.errors.ImageNotFound):
        return ImageNotFoundError(f"{what}: {text}; build it with `sandkernel image build`")
    return KernelStartError(f"{what}: {text}")


@functools.cache
def default_engine() -> DockerEngine:
    """The process-wide engine (one client, one connection pool)."""
    return DockerEngine()
