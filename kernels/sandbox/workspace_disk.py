"""A session's /workspace on disk: its own ext4 filesystem image, loop-mounted on the host.

Why not a tmpfs: tmpfs pages are charged to the sandbox's memory cgroup, so files and
variables share one limit (writing 800 MiB of files and then allocating 300 MiB ends in an
OOM kill, not "No space left on device"), and they vanish with the container. A filesystem
image of exactly ``workspace_mb`` gives a hard quota the kernel enforces: filling it returns
ENOSPC to the code, and the host's disk never pays more than the image size (a sparse file,
blocks are spent only as they are written). The image outlives the container, the gateway
process and a host reboot; it is deleted with the session.

Layout, under ``state_dir("workspaces")`` (root-only, 0700, see state_dir.py)::

    <session id>.img    the image (0600, sparse)
    <session id>.mnt/   its mount point; bind-mounted into the container at /workspace
    <session id>.owner  the process that holds it (labels.owner_label()), so a sweep of disks
                        no container or catalog names spares those of live processes

The filesystem is made with ``-m 0`` (the sandbox is not root, so root-reserved blocks would
only be a quota it cannot use), one inode per 8 KiB (pip installs are many small files), and
its root directory owned by the sandbox's uid and group, mode 0700. It is mounted ``nosuid``
and ``nodev`` (a planted setuid binary or device node means nothing) but not ``noexec``:
%pip-installed packages load their own ``.so`` files from it.

Nothing read from a record is trusted: a session id must be hex before it names a path, the
paths are recomputed from it (never taken from the record), and the image must be a regular
file of this user's (lstat: a symlink is refused, never followed). The host never opens the
tenant's files by path through the mount point (the sandbox can plant symlinks to host files
there): workspace_files.py reads them inside the container. The one host-side reader is per-cell
accounting (workspace_scan.py), which walks it relative to each directory's fd with O_NOFOLLOW
at every step, checks each step is the directory it listed, and never follows a link.

Every method here blocks (subprocesses, mounts): callers run them with ``asyncio.to_thread``.
Mounting needs root; :func:`disk_support` says whether this host can, and why not. This module
imports only the common base, the state dir and sparse_files.py, so the reaper can import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import struct
import subprocess
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from sandkernel.errors import AdoptionRefusedError, ConfigError, KernelStartError, SandboxLostError
from sandkernel.kernels.sandbox.sparse_files import allocated, copy_to_new_file
from sandkernel.kernels.sandbox.state_dir import state_dir

log = logging.getLogger(__name__)

WORKSPACES = "workspaces"
# Session ids are uuid4 hex (KernelSession) or a kernel id's uuid (Jupyter tools): lowercase hex
# and dashes, nothing that could make a path go elsewhere.
SESSION_ID = re.compile(r"[0-9a-f][0-9a-f-]{0,63}")
IMAGE_SUFFIX = ".img"
MOUNT_SUFFIX = ".mnt"
OWNER_SUFFIX = ".owner"
SUFFIXES = (IMAGE_SUFFIX, MOUNT_SUFFIX, OWNER_SUFFIX)
MAX_OWNER_BYTES = 256
MOUNT_OPTIONS = "loop,nosuid,nodev,noatime"
BYTES_PER_INODE = 8192
ROOT_MODE = 0o700
# linux/fs.h: freeze and thaw a mounted filesystem (through a descriptor of its root).
FIFREEZE = 0xC0045877
FITHAW = 0xC0045878
COMMAND_TIMEOUT = 60.0  # seconds for one mkfs/mount/umount
TOOL_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"
NOT_ROOT = (
    'workspace_storage "disk" needs the gateway to run as root (it loop-mounts a filesystem image '
    'per session); run it as root, or choose workspace_storage "memory" (a tmpfs charged to the '
    "sandbox's memory limit)"
)


def tool(name: str) -> str:
    """Absolute path of a system tool (mkfs.ext4, mount...), found in the system dirs only."""
    found = shutil.which(name, path=TOOL_PATH)
    if found is None:
        raise KernelStartError(f"{name} is not installed; disk workspaces need it (apt-get install e2fsprogs mount)")
    return found


def run_tool(argv: list[str]) -> None:
    """Run a system tool (argv list, no shell); a failure raises KernelStartError with its stderr."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernelStartError(f"{Path(argv[0]).name} failed: {err}") from err
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()[-500:]
        raise KernelStartError(f"{Path(argv[0]).name} failed (exit {done.returncode}): {detail}")


def check_session_id(session_id: Any) -> str:
    """The session id if it can name a path (lowercase hex and dashes), else ConfigError."""
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        shown = repr(session_id)[:80]
        raise ConfigError(f"workspace disk: session id {shown} is not hex; refusing to use it in a path")
    return session_id


def workspaces_dir() -> Path:
    """``state_dir("workspaces")``: created 0700, checked to be a directory of this user's."""
    return state_dir(WORKSPACES)


@dataclasses.dataclass(frozen=True)
class KeptWorkspace:
    """A workspace image a pause kept whole (:meth:`WorkspaceDisk.release_image`), checked and
    copied for a new sandbox of the session, and the uid that owns its files: the sandbox runs
    as that uid again, or its own files would be closed to it (the disk's root is 0700)."""

    image: Path
    uid: int

    def launch_kwargs(self) -> dict[str, object]:
        """What the provisioner's first launch takes for it (see provisioner.py)."""
        return {"sandkernel_workspace_image": str(self.image), "sandkernel_restore_uid": self.uid}


@dataclasses.dataclass(frozen=True)
class WorkspaceDisk:
    """One session's workspace image and mount point (a record: pure data and methods).

    The paths are derived from ``session_id`` and the state dir, never from a record: a record
    written by another process (or tampered with) cannot point this class elsewhere. The
    workspaces dir is the state dir's when the object is made, kept for its life: a process
    whose state dir changes meanwhile (in-process gateways of tests, each switching it) still
    unmounts and deletes what it made, not a namesake under another state dir.
    """

    session_id: str
    size_mb: int
    uid: int  # the sandbox's host uid: owner of the filesystem's root
    gid: int  # the sandbox group (container.SANDBOX_GID)
    directory: Path = dataclasses.field(default_factory=workspaces_dir, compare=False)

    def __post_init__(self) -> None:
        check_session_id(self.session_id)
        for name in ("size_mb", "uid", "gid"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"workspace disk: {name} {str(value)[:40]!r} is not a whole number")
        if self.size_mb < 1:
            raise ConfigError(f"workspace disk: size_mb {self.size_mb} is below 1")

    # -- where ------------------------------------------------------------------------------

    @property
    def image(self) -> Path:
        return self.directory / f"{self.session_id}{IMAGE_SUFFIX}"

    @property
    def owner_file(self) -> Path:
        return self.directory / f"{self.session_id}{OWNER_SUFFIX}"

    @property
    def mount_point(self) -> Path:
        """The host directory bind-mounted into the container at /workspace."""
        return self.directory / f"{self.session_id}{MOUNT_SUFFIX}"

    # -- lifecycle --------------------------------------------------------------------------

    @classmethod
    def create(cls, session_id: str, size_mb: int, uid: int, gid: int, owner: str = "") -> WorkspaceDisk:
        """Make, format and mount a new image for ``session_id`` (blocking). ``owner``: the
        creating process's owner label, recorded for :func:`sweep_workspace_disks`.

        Raises ConfigError when not root (:data:`NOT_ROOT`), KernelStartError when the image
        already exists, the host disk has less free space than ``size_mb``, or a tool fails;
        on failure nothing is left behind."""
        if os.geteuid() != 0:  # before the state dir is touched: not root makes nothing
            raise ConfigError(NOT_ROOT)
        disk = cls(session_id, size_mb, uid, gid)
        directory = disk.directory
        size = size_mb * 1024 * 1024
        free = os.statvfs(directory)
        if free.f_bavail * free.f_frsize < size:
            raise KernelStartError(
                f"the host disk under {directory} has {free.f_bavail * free.f_frsize // 2**20} MiB free; "
                f"the workspace needs {size_mb} MiB (free some space, or ask for a smaller workspace_mb)"
            )
        try:
            fd = os.open(disk.image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise KernelStartError(f"a workspace image for session {session_id} already exists") from None
        try:
            try:
                os.ftruncate(fd, size)  # sparse: host blocks are spent only as the sandbox writes
            finally:
                os.close(fd)
            if owner:
                disk.claim(owner)
            run_tool(
                [
                    tool("mkfs.ext4"),
                    "-q",
                    "-F",
                    "-m",
                    "0",
                    "-b",
                    "4096",
                    "-i",
                    str(BYTES_PER_INODE),
                    "-E",
                    f"lazy_itable_init=1,lazy_journal_init=1,root_owner={uid}:{gid}",
                    "-L",
                    "workspace",
                    str(disk.image),
                ]
            )
            disk.ensure_mounted(first=True)
        except BaseException:
            disk.remove()
            raise
        log.info("workspace disk created", extra={"session": session_id, "size_mb": size_mb})
        return disk

    @classmethod
    def from_image(
        cls, session_id: str, source: Path, size_mb: int, uid: int, gid: int, owner: str = ""
    ) -> WorkspaceDisk:
        """The disk of ``session_id`` from an image kept whole by :meth:`release_image` (a paused
        session's, checked against its snapshot and copied for this session by the caller):
        moved into place, not copied again where it can be, and mounted (blocking).

        Raises ConfigError when not root, KernelStartError when the image is not a regular file
        of ``size_mb`` MiB or the session already has one; on failure the session has no disk
        (``source`` may be gone)."""
        if os.geteuid() != 0:
            raise ConfigError(NOT_ROOT)
        disk = cls(session_id, size_mb, uid, gid)
        st = os.lstat(source)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != size_mb * 1024 * 1024:
            raise KernelStartError(
                f"the saved workspace image is not a regular file of {size_mb} MiB; the session's profile asks for that"
            )
        if os.path.lexists(disk.image):
            raise KernelStartError(f"a workspace image for session {session_id} already exists")
        try:
            move_file(source, disk.image)
            if owner:
                disk.claim(owner)
            disk.ensure_mounted()
        except BaseException:
            disk.remove()
            raise
        log.info("workspace disk restored", extra={"session": session_id, "size_mb": size_mb})
        return disk

    def copy_image(self, target: Path) -> None:
        """Copy the mounted disk's image to ``target`` (a new path, 0600, holes kept) while its
        filesystem is frozen (FIFREEZE: its writes flushed to the image and new ones held until
        the thaw), so the copy is a consistent filesystem although the sandbox goes on running.
        Blocking; the thaw comes whatever happens."""
        self.check_image()
        directory = os.open(self.mount_point, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not self.is_mounted():
                raise KernelStartError(f"workspace disk of session {self.session_id} is not mounted; nothing to copy")
            fcntl.ioctl(directory, FIFREEZE, 0)
            try:
                copy_to_new_file(self.image, target)
            finally:
                fcntl.ioctl(directory, FITHAW, 0)
        finally:
            os.close(directory)

    def flush(self) -> None:
        """Write the mounted filesystem's dirty data to its image now (blocking; nothing when it
        is not mounted). Harmless while the sandbox runs: a pause or a fork starts it beside the
        memory checkpoint, so that their own flush once the sandbox has stopped (the unmount's,
        the freeze's) has little left to write: 0.2 s of a pause of a 200 MB workspace here."""
        if self.is_mounted():
            run_tool([tool("sync"), "-f", str(self.mount_point)])

    def thaw(self) -> None:
        """Thaw the mounted filesystem if a copy left it frozen (a gateway that died during
        :meth:`copy_image`); nothing if it is not frozen or not mounted."""
        try:
            directory = os.open(self.mount_point, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            with contextlib.suppress(OSError):  # EINVAL: it was not frozen
                fcntl.ioctl(directory, FITHAW, 0)
        finally:
            os.close(directory)

    def release_image(self, target: Path) -> None:
        """Unmount the disk and move its image to ``target`` (a new path), whole: what a pause
        keeps of the session's files when its sandbox has ended (blocking). The blocks of deleted
        files are given back first (fstrim through the loop device punches them out of the
        image), so the image takes on disk what the files do. The disk is gone from the
        workspaces dir afterwards."""
        if self.is_mounted():
            with contextlib.suppress(KernelStartError):  # a filesystem that cannot trim keeps its blocks
                # Committed first: ext4 trims only the blocks of deletions its journal committed.
                run_tool([tool("sync"), "-f", str(self.mount_point)])
                run_tool([tool("fstrim"), str(self.mount_point)])
            run_tool([tool("umount"), str(self.mount_point)])  # busy: it fails, and the disk stays
        detach_loops(self.image)
        self.check_image()
        move_file(self.image, target)
        self.remove()
        log.info("workspace disk kept whole", extra={"session": self.session_id})

    @classmethod
    def open(cls, session_id: str, size_mb: int, uid: int, gid: int) -> WorkspaceDisk:
        """An existing session's disk, checked and mounted (after a gateway restart or a host
        reboot). Raises SandboxLostError when the image is gone, AdoptionRefusedError when it is
        not ours, KernelStartError when mount fails."""
        disk = cls(session_id, size_mb, uid, gid)
        disk.ensure_mounted()
        return disk

    def to_dict(self) -> dict[str, Any]:
        """The durable record (JSON). Paths are informative only: :meth:`from_dict` ignores them."""
        return {
            "session_id": self.session_id,
            "size_mb": self.size_mb,
            "uid": self.uid,
            "gid": self.gid,
            "image": str(self.image),
            "mount_point": str(self.mount_point),
        }

    @classmethod
    def from_dict(cls, data: Any) -> WorkspaceDisk:
        """Rebuild from :meth:`to_dict`, validating every field (AdoptionRefusedError). The
        recorded paths must be the ones this state dir gives the session: a record that names
        another place is refused, not followed. Touches nothing but an lstat of the dir."""
        if not isinstance(data, dict):
            raise AdoptionRefusedError("workspace disk record is not an object")
        try:
            disk = cls(data.get("session_id"), data.get("size_mb"), data.get("uid"), data.get("gid"))
        except ConfigError as err:
            raise AdoptionRefusedError(f"{err}; the record is left alone") from None
        for key, expected in (("image", disk.image), ("mount_point", disk.mount_point)):
            if key in data and data[key] != str(expected):
                raise AdoptionRefusedError(
                    f"workspace disk record names {key} {str(data[key])[:200]!r}, not {expected}: "
                    "was the state dir changed? Refusing to use it"
                )
        return disk

    def claim(self, owner: str) -> None:
        """Record ``owner`` (an owner label) as the process holding this disk (a process that
        adopts the session calls it too). Replaced atomically; never follows a link."""
        data = owner.encode()[:MAX_OWNER_BYTES]
        tmp = self.owner_file.with_name(f".{self.owner_file.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, self.owner_file)

    def owner(self) -> str | None:
        """The recorded owner label, or None (none recorded, or not a small regular file)."""
        try:
            fd = os.open(self.owner_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return f.read(MAX_OWNER_BYTES).decode(errors="replace")

    def check_image(self) -> os.stat_result:
        """lstat the image: a regular file (not a symlink) of this user's, of the recorded size.
        Raises SandboxLostError when it is gone (the files are lost), AdoptionRefusedError when
        it is not what the record says."""
        try:
            st = os.lstat(self.image)
        except FileNotFoundError:
            raise SandboxLostError(f"its workspace image {self.image} is gone") from None
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise AdoptionRefusedError(f"workspace image {self.image} is not a regular file of this user's")
        if st.st_size != self.size_mb * 1024 * 1024:
            raise AdoptionRefusedError(
                f"workspace image {self.image} is {st.st_size} bytes, the record says {self.size_mb} MiB"
            )
        return st

    def allocated_bytes(self) -> int:
        """What the image takes on the host's disk (its blocks; never more than its size)."""
        return allocated(os.lstat(self.image))

    def is_mounted(self) -> bool:
        """Whether our image is mounted at the mount point (the loop device's backing file is
        checked: something else mounted there raises AdoptionRefusedError)."""
        source = mount_source(self.mount_point)
        if source is None:
            return False
        if not loop_backs(source, self.image):
            raise AdoptionRefusedError(
                f"{self.mount_point} has {source} mounted (backed by {loop_backing_file(source)}), "
                "not the workspace image"
            )
        return True

    def ensure_mounted(self, first: bool = False) -> None:
        """Mount the image at the mount point unless it already is (idempotent: after a host
        reboot the image is there but not mounted). ``first``: a fresh filesystem, whose root
        gets mode 0700 and loses ext4's lost+found (the workspace starts empty)."""
        if os.geteuid() != 0:
            raise ConfigError(NOT_ROOT)
        self.check_image()
        if self.is_mounted():
            self.thaw()
            return
        try:
            os.mkdir(self.mount_point, 0o700)
        except FileExistsError:
            st = os.lstat(self.mount_point)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise AdoptionRefusedError(f"{self.mount_point} is not a directory of this user's") from None
        run_tool([tool("mount"), "-t", "ext4", "-o", MOUNT_OPTIONS, str(self.image), str(self.mount_point)])
        if not self.is_mounted():
            raise KernelStartError(f"mount of {self.image} at {self.mount_point} did not take")
        if first:
            os.chmod(self.mount_point, ROOT_MODE)  # the filesystem's root, now mounted there
            os.rmdir(self.mount_point / "lost+found")

    def remove(self) -> None:
        """Unmount, detach the loop device, delete the image and the mount point. Safe to call
        twice, and on a half-made disk. The container using it must be gone first (else the
        unmount is lazy and the loop device goes when the container does)."""
        try:
            mounted = self.is_mounted()
        except AdoptionRefusedError:
            mounted = mount_source(self.mount_point) is not None  # someone else's: leave it mounted
            if mounted:
                log.warning("workspace mount point %s holds a foreign mount; not removed", self.mount_point)
                return
        if mounted:
            try:
                run_tool([tool("umount"), str(self.mount_point)])
            except KernelStartError as err:  # busy: a process still holds it
                log.warning("workspace unmount failed (%s); detaching lazily", err)
                run_tool([tool("umount"), "-l", str(self.mount_point)])
        detach_loops(self.image)
        try:
            st = os.lstat(self.image)
            if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                os.unlink(self.image)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self.mount_point)
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("cannot remove workspace mount point %s: %s", self.mount_point, err)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.owner_file)
        log.info("workspace disk removed", extra={"session": self.session_id})


def move_file(source: Path, target: Path) -> None:
    """Move a file to a new path: renamed within a filesystem, else copied with its holes and
    the source removed. The target is made 0600 and never through a link."""
    try:
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, "exists", str(target))
        os.rename(source, target)
        os.chmod(target, 0o600, follow_symlinks=False)
        return
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
    copy_to_new_file(source, target, durable=True)
    os.unlink(source)


def remove_workspace_disk(session_id: str) -> bool:
    """Remove the disk of ``session_id`` if there is one (for the reaper and the catalog's
    clean-up: a session whose container is gone for good). True if anything was there.
    Blocking; refuses ids that are not hex (ConfigError)."""
    check_session_id(session_id)
    directory = workspaces_dir()
    if not any(os.path.lexists(directory / f"{session_id}{suffix}") for suffix in SUFFIXES):
        return False
    # size and owner do not matter for removal; 1 and 0 satisfy the record's checks.
    WorkspaceDisk(session_id, 1, 0, 0, directory).remove()
    return True


def leftover_session_ids() -> list[str]:
    """Session ids that have an image, a mount point or an owner file under the workspaces dir
    (for a reaper to compare with the sessions it knows)."""
    found = set()
    for entry in os.scandir(workspaces_dir()):
        for suffix in SUFFIXES:
            name = entry.name.removesuffix(suffix)
            if entry.name.endswith(suffix) and SESSION_ID.fullmatch(name):
                found.add(name)
    return sorted(found)


def sweep_workspace_disks(keep: Collection[str], owner_alive: Callable[[str], bool]) -> list[str]:
    """Remove the disks no one holds: not in ``keep`` (the catalogued sessions and those any
    container is labelled with) and whose owner is not alive (or unrecorded). Returns their
    session ids. Blocking; for the reaper, after it removed the containers it reaps.

    Why the owner check: a live process has a disk without a container for a moment (made just
    before its first container, or between a dead container and its replacement)."""
    swept = []
    for session_id in leftover_session_ids():
        if session_id in keep:
            continue
        owner = WorkspaceDisk(session_id, 1, 0, 0).owner()
        if owner and owner_alive(owner):
            continue
        log.info("sweeping a workspace disk no one holds", extra={"session": session_id, "owner": owner})
        remove_workspace_disk(session_id)
        swept.append(session_id)
    return swept


# -- the host's mount table -------------------------------------------------------------------


def _unescape(field: str) -> str:
    """/proc/self/mountinfo escapes space, tab, newline and backslash as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_source(mount_point: Path) -> str | None:
    """The source (e.g. /dev/loop3) of the topmost mount at exactly ``mount_point``, or None."""
    source = None
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) >= 5 and _unescape(parts[4]) == os.path.realpath(mount_point):
            tail = rest.split()
            source = _unescape(tail[1]) if len(tail) >= 2 else ""
    return source


def loop_backing_file(device: str) -> str | None:
    """The file behind a loop device (``/dev/loopN``), from sysfs; None if not a loop device."""
    match = re.fullmatch(r"/dev/(loop[0-9]+)", device)
    if not match:
        return None
    try:
        return Path(f"/sys/block/{match.group(1)}/loop/backing_file").read_text().strip()
    except OSError:
        return None


# LOOP_GET_STATUS64 (linux/loop.h) fills a struct loop_info64, whose first two fields are the
# backing file's device (the kernel's new_encode_dev) and inode number.
LOOP_GET_STATUS64 = 0x4C05
LOOP_INFO64_SIZE = 232


def _new_encode_dev(dev: int) -> int:
    """The kernel's ``new_encode_dev``: how loop_info64.lo_device encodes a device number."""
    major, minor = os.major(dev), os.minor(dev)
    return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)


def loop_backing_identity(device: str) -> tuple[int, int] | None:
    """(device, inode) of the file behind a loop device, from the loop driver itself; None if
    ``device`` is not a loop device or cannot be asked."""
    if not re.fullmatch(r"/dev/loop[0-9]+", device):
        return None
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        info = fcntl.ioctl(fd, LOOP_GET_STATUS64, bytes(LOOP_INFO64_SIZE))
    except OSError:
        return None
    finally:
        os.close(fd)
    lo_device, lo_inode = struct.unpack_from("=QQ", info)
    return lo_device, lo_inode


def loop_backs(device: str, image: Path) -> bool:
    """Whether the loop device's backing file is ``image``: the same inode on the same device.

    Compared by identity, not by ``/sys/block/loopN/loop/backing_file``: that path is the one the
    file was opened by, in the mount namespace that set the loop up. A gateway in a container
    opens the image through its bind mount of the state dir; once that container is gone (a
    restart, a rolling upgrade) the kernel prints the path from the detached mount's root
    (``/workspaces/<id>.img``), and a path comparison would refuse every session the next
    gateway adopts."""
    try:
        st = os.stat(image, follow_symlinks=False)
    except OSError:
        return False
    identity = loop_backing_identity(device)
    return identity is not None and identity == (_new_encode_dev(st.st_dev), st.st_ino)


def detach_loops(image: Path) -> None:
    """Detach every loop device still backed by ``image`` (mount's autoclear normally did)."""
    try:
        devices = sorted(Path("/sys/block").glob("loop*/loop/backing_file"))
    except OSError:
        return
    for backing in devices:
        device = f"/dev/{backing.parent.parent.name}"
        if not loop_backs(device, image):
            continue
        try:
            run_tool([tool("losetup"), "-d", device])
        except KernelStartError as err:
            log.warning("cannot detach %s: %s", device, err)


def disk_support() -> tuple[bool, str]:
    """Whether disk workspaces work on this host, and a sentence why (or why not): root,
    mkfs.ext4, mount and a loop device. Blocking, cheap; for ``sandkernel doctor``."""
    if os.geteuid() != 0:
        return False, "not root: " + NOT_ROOT
    for name in ("mkfs.ext4", "mount", "umount", "losetup"):
        if shutil.which(name, path=TOOL_PATH) is None:
            return False, f"{name} is not installed (apt-get install e2fsprogs mount)"
    if not os.path.exists("/dev/loop-control"):
        return False, "no /dev/loop-control: the loop driver is not available (modprobe loop)"
    return True, "root, loop devices, mkfs.ext4 and mount available"
