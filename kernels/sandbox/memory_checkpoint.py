"""Save a savable gVisor sandbox's memory to a directory, and start a new container from it.

How, and why this way (measured on Docker 20.10 with gVisor 20240729, docs/snapshots.md):

- **Save** drives ``runsc checkpoint`` itself, uncompressed: Docker's ``docker checkpoint create``
  compresses the image and took 3.9 s for a 200 MB kernel where runsc alone took 0.6 s. The
  sandbox's PID 1 (kernel-image/kernel_supervisor.py) first lets go of its host sockets, which
  gVisor cannot save (SandboxContainer.save_memory waits for it to say so). The checkpoint
  ends the container (Docker sees it exit).
- **Restore into a new container** goes through Docker, so the new sandbox is an ordinary
  container of Docker's (exec, inspect, stats, removal all work): the image directory is placed in
  the new container's ``checkpoints/`` folder and the container is started with
  ``?checkpoint=``. Docker refuses ``--checkpoint-dir`` for this and documents a restore into the
  same container only, but gVisor reopens every mount by its destination, so a container created
  from the same image and settings with other host sources (its own runtime dir, workspace disk)
  takes the image. Docker needs ``"experimental": true`` for it (scripts/host-setup.sh).

The image is sandbox memory: tenant data, and hostile. The caller seals it (HMAC) and keeps it
0600 like a snapshot archive; runsc parses it inside the new sandbox's sentry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import logging
import os
import shutil
from pathlib import Path

import docker.errors

from sandkernel.errors import KernelStartError, SnapshotError
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, translate_api_error

log = logging.getLogger(__name__)

# Where Docker 20.10 keeps each runtime's state (runsc's ``--root``): the one holding the
# container's state file (runsc names it ``<id>_sandbox:<id>.state``) is the container's.
RUNTIME_ROOTS = "/var/run/docker/runtime-*/moby"
CHECKPOINT_NAME = "sandkernel"
CHECKPOINT_TIMEOUT = 120.0  # seconds for runsc to write the image


@dataclasses.dataclass(frozen=True)
class SavedMemory:
    """A kernel's saved memory to start a new sandbox from: runsc's image directory and the uid
    its processes run as (they keep their credentials through the restore)."""

    image_dir: Path
    uid: int

    def launch_kwargs(self) -> dict[str, object]:
        """What the provisioner's first launch takes for it (see provisioner.py)."""
        return {"sandkernel_restore_from": str(self.image_dir), "sandkernel_restore_uid": self.uid}


def runtime_root(container_id: str) -> str:
    """runsc's state root for ``container_id`` (the Docker runtime dir that holds it)."""
    for root in glob.glob(RUNTIME_ROOTS):
        if glob.glob(os.path.join(root, f"{container_id}_sandbox:*.state")):
            return root
    raise SnapshotError(f"no runtime state for container {container_id[:12]}: is it a running gVisor sandbox?")


async def run_runsc_checkpoint(runsc: str, container_id: str, image_dir: Path, *, leave_running: bool = False) -> None:
    """``runsc checkpoint`` of a detached sandbox into ``image_dir`` (made empty, 0700);
    ``leave_running``: the sandbox goes on afterwards (a fork's parent), else it ends."""
    root = await asyncio.to_thread(runtime_root, container_id)
    await asyncio.to_thread(image_dir.mkdir, mode=0o700, parents=True, exist_ok=False)
    argv = [runsc, f"--root={root}", "checkpoint", f"--image-path={image_dir}", "--compression=none"]
    argv += ["--leave-running", container_id] if leave_running else [container_id]
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), CHECKPOINT_TIMEOUT)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        raise SnapshotError(f"runsc checkpoint did not finish within {CHECKPOINT_TIMEOUT:g} s") from None
    if process.returncode != 0:
        text = output.decode(errors="replace").strip()[-2000:]
        raise SnapshotError(f"runsc checkpoint failed (exit {process.returncode}): {text}")
    await asyncio.to_thread(keep_private, image_dir)


def keep_private(image_dir: Path) -> None:
    """The image is tenant data: 0600, like a snapshot archive."""
    for entry in image_dir.iterdir():
        os.chmod(entry, 0o600)


async def start_from_checkpoint(engine: DockerEngine, container_id: str, image_dir: Path) -> None:
    """Start the created container ``container_id`` from the image in ``image_dir``."""
    api = engine.client.api

    def place_and_start() -> None:
        root = engine.client.info()["DockerRootDir"]
        target = Path(root) / "containers" / container_id / "checkpoints" / CHECKPOINT_NAME
        target.parent.mkdir(mode=0o700, exist_ok=True)
        # Hard links where the image shares Docker's filesystem: a fork of k starts k sandboxes
        # from one image without k copies of it (runsc only reads the files).
        shutil.copytree(image_dir, target, copy_function=link_or_copy)
        try:
            url = api._url("/containers/{0}/start", container_id)
            response = api._post(url, params={"checkpoint": CHECKPOINT_NAME})
            api._raise_for_status(response)
        finally:
            shutil.rmtree(target, ignore_errors=True)  # runsc has read it (or failed to)

    try:
        await engine.run(place_and_start)
    except docker.errors.APIError as err:
        raise translate_api_error(err, "cannot start the sandbox from its memory checkpoint") from err
    except OSError as err:
        raise KernelStartError(f"cannot place the memory checkpoint for the new sandbox: {err}") from err


def link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
