"""Async access to the Docker engine, with its errors translated into sandkernel's.

The Docker SDK is blocking, so every call runs in a worker thread (``asyncio.to_thread``):
one slow ``containers.list()`` must never stall the gateway's event loop. Other modules use
:class:`DockerEngine` and catch ``docker.errors`` only where they translate them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import docker
import docker.errors

from sandkernel.errors import (
    DockerUnavailableError,
    ImageNotFoundError,
    KernelStartError,
    RuntimeUnavailableError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

DOCKER_HINT = "start it with `bash scripts/host-setup.sh` (as root) or `dockerd &`, then retry"


class DockerEngine:
    """One Docker client shared by a process, used from worker threads."""

    def __init__(self, client: docker.DockerClient | None = None) -> None:
        self._client = client
        self._lock = threading.Lock()

    @property
    def client(self) -> docker.DockerClient:
        """The SDK client, created on first use (blocking: call from a worker thread)."""
        with self._lock:
            if self._client is None:
                try:
                    self._client = docker.from_env(timeout=120)
                    self._client.ping()
                except docker.errors.DockerException as err:
                    self._client = None
                    raise DockerUnavailableError(f"cannot reach the Docker engine ({err}); {DOCKER_HINT}") from err
            return self._client

    async def run(self, func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking SDK call in a worker thread, translating connection errors."""
        try:
            return await asyncio.to_thread(func, *args, **kwargs)
        except docker.errors.DockerException as err:
            if isinstance(err, docker.errors.APIError):
                raise
            raise DockerUnavailableError(f"Docker engine error ({err}); {DOCKER_HINT}") from err

    # -- checks made before anything is created, so bad input leaves nothing behind ---------

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
