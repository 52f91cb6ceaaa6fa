"""Save a savable gVisor sandbox's memory to a directory, and start a new container from it.

How, and why this way (measured on Docker 20.10 with gVisor 20240729, docs/snapshots.md):

- **Save** drives ``runsc checkpoint`` itself, uncompressed: Docker's ``docker checkpoint create``
  compresses the image and took 3.9 s for a 200 MB kernel where runsc alone took 0.6 s. The
  sandbox's PID 1 (kernel-image/kernel_supervisor.py) first lets go of its host sockets, which
  gVisor cannot save (SandboxContainer.save_memory waits for it to say so). The checkpoint
  ends the container (Docker sees it exit).
- **Restore into a new container** goes through Docker, so the new sandbox is an ordinary
  container of Docker's (exec, inspect, stats, removal all work). A container is created from the
  same image and settings with other host sources (its own runtime dir, workspace disk): gVisor
  reopens every mount by its destination. It is started as usual, and Docker's runsc, sandkernel's
  wrapper (scripts/sandkernel-runsc), finds the image through ``RESTORE_DIR/<container id>`` and
  runs ``runsc restore`` where ``runsc create`` would have run. Docker's own start from a
  checkpoint (``?checkpoint=``, experimental) tars the image into containerd's content store and
  unpacks it again first: 3.9 s against 0.6 s here at 200 MB, and containerd 1.6 leaves the
  unpacked copy of the tenant's memory behind in /tmp.

The image is sandbox memory: tenant data, and hostile. The caller seals it (HMAC) and keeps it
0600 like a snapshot archive; runsc parses it inside the new sandbox's sentry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import logging
import os
import stat
from pathlib import Path

import docker.errors

from sandkernel.errors import KernelStartError, SnapshotError
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, translate_api_error
from sandkernel.kernels.sandbox.uncached_io import supports_uncached

log = logging.getLogger(__name__)

# Where Docker 20.10 keeps each runtime's state (runsc's ``--root``): the one holding the
# container's state file (runsc names it ``<id>_sandbox:<id>.state``) is the container's.
RUNTIME_ROOTS = "/var/run/docker/runtime-*/moby"
# Where the gateway tells Docker's runsc (scripts/sandkernel-runsc, which names the same path)
# to restore a container instead of creating it: ``<container id>`` links to the image directory,
# and the wrapper marks ``<container id>.restored`` when it did. Root's alone, mounted nowhere.
RESTORE_DIR = Path("/run/sandkernel-restore")
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
    if await asyncio.to_thread(supports_uncached, image_dir):
        argv.append("--direct")  # the pages bypass the page cache (uncached_io.py says why)
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
    """Start the created container ``container_id`` from the image in ``image_dir``, in place."""
    entry = RESTORE_DIR / container_id
    restored = RESTORE_DIR / f"{container_id}.restored"
    direct = RESTORE_DIR / f"{container_id}.direct"

    def place_and_start() -> bool:
        open_restore_dir()
        os.symlink(image_dir.resolve(), entry)
        try:
            if supports_uncached(image_dir.parent):  # read past the page cache, as it was written
                direct.touch(mode=0o600)
            engine.client.api.start(container_id)
            return restored.exists()
        finally:
            entry.unlink(missing_ok=True)
            restored.unlink(missing_ok=True)
            direct.unlink(missing_ok=True)

    try:
        took_the_image = await engine.run(place_and_start)
    except docker.errors.APIError as err:
        raise translate_api_error(err, "cannot start the sandbox from its memory checkpoint") from err
    except OSError as err:
        raise KernelStartError(f"cannot hand the memory checkpoint to the new sandbox: {err}") from err
    if not took_the_image:
        raise KernelStartError(
            "Docker's runsc runtime started the sandbox afresh instead of from its memory checkpoint:"
            " it is not sandkernel's (run scripts/host-setup.sh as root; `sandkernel doctor` checks it)"
        )


def open_restore_dir() -> None:
    """RESTORE_DIR, made if missing: a root-owned 0700 directory and never a link (the wrapper
    that reads it runs as root)."""
    RESTORE_DIR.mkdir(mode=0o700, exist_ok=True)
    status = os.lstat(RESTORE_DIR)
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise KernelStartError(f"{RESTORE_DIR} must be a directory of the gateway's user, mode 0700")
