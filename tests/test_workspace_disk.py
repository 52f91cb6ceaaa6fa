"""The disk workspace: a hard quota (ENOSPC, never the host's disk or the sandbox's memory),
kept across kernel restarts and container replacement, removed with the session, and a
record read back from the catalog is checked before it names any path.

Against real containers under both runtimes; the record checks are pure (no engine)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys

import pytest

from sandkernel.errors import AdoptionRefusedError, ConfigError, KernelStartError, SandboxLostError
from sandkernel.kernels.execution.outputs import ExecutionStatus
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.catalog import ProfileCatalog
from sandkernel.kernels.model.profiles import Runtime, WorkspaceStorage
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.exec_stream import SIGKILL_EXIT
from sandkernel.kernels.sandbox.state_dir import use_state_dir
from sandkernel.kernels.sandbox.workspace_disk import (
    WorkspaceDisk,
    leftover_session_ids,
    loop_backing_file,
    loop_backs,
    mount_source,
    remove_workspace_disk,
    sweep_workspace_disks,
)

from .conftest import RUNC, RUNTIME_PARAMS, require_runtime

MIB = 2**20
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="disk workspaces need root (loop mounts)")


async def start(runtime: str, **overrides) -> KernelSession:
    require_runtime(runtime)
    return await KernelSession.start(overrides={"runtime": runtime, "cpus": 0.5, "pids": 128, **overrides})


async def run_json(session: KernelSession, code: str) -> dict:
    result = await session.execute(code)
    assert result.status is ExecutionStatus.OK, result
    return json.loads(result.text.strip().splitlines()[-1])


def disk_of(session: KernelSession) -> WorkspaceDisk:
    disk = session._kernel.provisioner.workspace_disk
    assert disk is not None, "the session has no disk workspace"
    return disk


def loop_devices_of(image: str) -> str:
    return subprocess.run(["losetup", "-j", image], capture_output=True, text=True, check=True).stdout.strip()


def assert_gone(disk: WorkspaceDisk) -> None:
    """Nothing of the disk is left on the host: image, mount point, mount, loop device."""
    image, mount_point = str(disk.image), str(disk.mount_point)
    assert not os.path.lexists(image) and not os.path.lexists(mount_point)
    assert mount_source(disk.mount_point) is None
    assert loop_devices_of(image) == ""


FILL = """import json, os
fd = os.open('/workspace/fill', os.O_WRONLY | os.O_CREAT, 0o600)
chunk, written, err = b'x' * 2**20, 0, None
try:
    while True:
        written += os.write(fd, chunk)
except OSError as e:
    err = e.errno
finally:
    try:
        os.close(fd)
    except OSError as e:
        err = err or e.errno
print(json.dumps({"errno": err, "written": written}))"""


@needs_root
@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_filling_the_workspace_gives_enospc_and_costs_the_host_at_most_the_quota(runtime):
    session = await start(runtime, workspace_mb=64)
    try:
        disk = disk_of(session)
        found = await run_json(session, FILL)
        assert found["errno"] == errno.ENOSPC, found
        # -m 0: nearly all of it is the sandbox's (ext4's own metadata takes the rest)
        assert 56 * MIB <= found["written"] <= 64 * MIB, found
        # the host pays for blocks written, never more than the image's size
        st = os.stat(disk.image)
        assert st.st_size == 64 * MIB
        assert st.st_blocks * 512 <= 64 * MIB + 256 * 1024, st.st_blocks * 512
        assert (await session.execute("print(6 * 7)")).text.strip() == "42"
        freed = await session.execute("import os; os.unlink('/workspace/fill'); open('/workspace/a', 'w').write('ok')")
        assert freed.status is ExecutionStatus.OK, freed
    finally:
        await session.shutdown()
    assert_gone(disk)


WRITE_THEN_ALLOCATE = """import os
for i in range(30):
    fd = os.open(f'/workspace/data-{i}', os.O_WRONLY | os.O_CREAT, 0o600)
    for _ in range(10):
        os.write(fd, os.urandom(2**20))
    os.close(fd)
block = b'y' * (150 * 2**20)
print(len(block) // 2**20, sum(os.path.getsize(f'/workspace/data-{i}') for i in range(30)) // 2**20)"""


@pytest.mark.docker
@needs_root
@pytest.mark.parametrize(
    ("runtime", "storage", "expected"),
    [
        ("runc", "disk", ExecutionStatus.OK),
        pytest.param("runsc", "disk", ExecutionStatus.OK, marks=pytest.mark.runsc),
        # the control: the same files in a tmpfs are charged to the memory limit
        ("runc", "memory", ExecutionStatus.OOM),
    ],
)
async def test_workspace_files_are_not_charged_to_memory(runtime, storage, expected):
    """256 MiB of memory, 300 MiB of files, then 150 MiB allocated: fine on disk, OOM in a tmpfs."""
    session = await start(runtime, memory_mb=256, workspace_mb=512, workspace_storage=storage)
    try:
        result = await session.execute(WRITE_THEN_ALLOCATE, timeout=240)
        assert result.status is expected, result
        if expected is ExecutionStatus.OK:
            assert result.text.split() == ["150", "300"]
    finally:
        await session.shutdown()


@pytest.mark.parametrize("runtime", [RUNC])
async def test_a_tmpfs_workspace_that_leaves_no_room_for_a_kernel_gets_a_new_container(runtime):
    """Files in a tmpfs workspace fill the memory limit between executions (from outside the
    kernel, so all of them land): the kernel is killed for memory, and a restarted one would
    be too (tmpfs pages are never reclaimed). The next execute replaces the container, says
    so, and runs; before, it raised KernelStartError and the session had no kernel."""
    session = await start(runtime, memory_mb=256, workspace_mb=512, workspace_storage="memory")
    try:
        assert (await session.execute("open('/workspace/before', 'w').write('x')")).status is ExecutionStatus.OK
        provisioner = session._kernel.provisioner
        container = default_engine().client.containers.get(provisioner.container.id)
        # 240 of 256 MiB: the kernel is the biggest process, so the OOM killer takes it first;
        # the writer is killed too (137) only when the cgroup's own overhead left no room even then
        filled = await asyncio.to_thread(
            container.exec_run, ["sh", "-c", "head -c 240M /dev/zero > /workspace/fill"], user=str(provisioner.uid)
        )
        assert filled.exit_code in (0, SIGKILL_EXIT), filled.output
        # Topped up until the limit stops the writer: when the OOM killer took the writer too, the
        # first fill ended early, and a restarted kernel could fit in the room it left (seen).
        topped = await asyncio.to_thread(
            container.exec_run, ["sh", "-c", "head -c 64M /dev/zero >> /workspace/fill"], user=str(provisioner.uid)
        )
        assert topped.exit_code == SIGKILL_EXIT, (topped.exit_code, topped.output)
        old = provisioner.container.id
        result = await session.execute("import os; print(sorted(os.listdir('/workspace')))", timeout=120)
        assert result.status is ExecutionStatus.OK, result
        listed = result.text.strip()
        assert "before" not in listed and "fill" not in listed, listed  # the tmpfs went with the container
        assert result.state_lost is not None
        assert "ran out of memory" in result.state_lost and "container was replaced" in result.state_lost
        assert session._kernel.provisioner.container.id != old
        assert (await session.execute("print(6 * 7)")).text.strip() == "42"
    finally:
        await session.shutdown()


KEEP = "import os; os.makedirs('/workspace/d', exist_ok=True); open('/workspace/d/keep.txt', 'w').write('still here')"
READ = "import os; print(open('/workspace/d/keep.txt').read() if os.path.exists('/workspace/d/keep.txt') else 'gone')"


@needs_root
@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_files_survive_a_kernel_restart_and_a_container_replacement(runtime):
    session = await start(runtime, workspace_mb=64)
    try:
        disk = disk_of(session)
        assert (await session.execute(KEEP)).status is ExecutionStatus.OK
        await session.restart()
        assert (await session.execute(READ)).text.strip() == "still here"

        # the container dies under the session: the next launch replaces it, same disk
        provisioner = session._kernel.provisioner
        old = provisioner.container.id
        engine = default_engine()
        await engine.run(engine.client.api.kill, old)
        await session.restart()
        assert provisioner.container.id != old
        assert provisioner.container_replaced and not provisioner.workspace_lost
        assert disk_of(session) == disk
        assert (await session.execute(READ)).text.strip() == "still here"
    finally:
        await session.shutdown()
    assert_gone(disk)


@needs_root
@pytest.mark.parametrize("runtime", [RUNC])
async def test_files_survive_the_ladders_last_rung(runtime):
    """The ladder's last rung throws the whole kernel manager away (SandboxedKernel.replace)."""
    session = await start(runtime, workspace_mb=64)
    disks = [disk_of(session)]
    try:
        assert (await session.execute(KEEP)).status is ExecutionStatus.OK
        kernel_id = session.kernel_id
        await session._kernel.replace()
        assert session.kernel_id == kernel_id  # as after a restart: a client holding it carries on
        disks.append(disk_of(session))
        assert (await session.execute(READ)).text.strip() == "still here"
    finally:
        await session.shutdown()
        for disk in disks:
            assert_gone(disk)


@needs_root
@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_no_device_nodes_or_root_owned_setuid_files_but_code_may_run(runtime):
    """nodev and nosuid on the host mount, no CAP_MKNOD or CAP_CHOWN in the sandbox; exec stays
    allowed, so %pip-installed extension modules load from /workspace."""
    session = await start(runtime, workspace_mb=64)
    try:
        disk = disk_of(session)
        found = await run_json(
            session,
            """import glob, importlib.util, json, os, shutil, stat, subprocess, sys
out = {}
try:
    os.mknod('/workspace/null', stat.S_IFCHR | 0o666, os.makedev(1, 3)); out['mknod'] = 'made'
except OSError as e:
    out['mknod'] = e.errno
shutil.copy('/usr/bin/id', '/workspace/myid'); os.chmod('/workspace/myid', 0o4755)
try:
    os.chown('/workspace/myid', 0, 0); out['chown'] = 'root'
except OSError as e:
    out['chown'] = e.errno
out['exec'] = subprocess.run(['/workspace/myid', '-u'], capture_output=True, text=True).stdout.strip()
out['uid'] = os.getuid()
so = glob.glob(sys.base_prefix + '/lib/python3*/lib-dynload/_json*.so')[0]
os.makedirs('/workspace/pkg', exist_ok=True); shutil.copy(so, '/workspace/pkg/')
spec = importlib.util.spec_from_file_location('_json', '/workspace/pkg/' + os.path.basename(so))
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
out['so'] = hasattr(module, 'make_scanner')
print(json.dumps(out))""",
        )
        assert found["mknod"] == errno.EPERM, found
        assert found["chown"] == errno.EPERM, found
        assert found["exec"] == str(found["uid"]), found  # exec works, and never as anyone else
        assert found["so"] is True, found
        with open("/proc/self/mountinfo") as f:
            options = next(line.split()[5] for line in f if line.split()[4] == str(disk.mount_point))
        assert {"nosuid", "nodev"} <= set(options.split(",")), options
        assert "noexec" not in options.split(",")
        st = os.stat(disk.mount_point)  # the filesystem's root: the sandbox's, 0700
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (disk.uid, disk.gid, 0o700)
    finally:
        await session.shutdown()
    assert_gone(disk)


@needs_root
@pytest.mark.parametrize("runtime", [RUNC])
async def test_a_memory_workspace_makes_no_disk(runtime):
    session = await start(runtime, workspace_storage="memory", workspace_mb=32)
    try:
        assert session.profile.workspace_storage is WorkspaceStorage.MEMORY
        assert session._kernel.provisioner.workspace_disk is None
        found = await run_json(
            session,
            "import json; print(json.dumps([l.split()[2] for l in open('/proc/mounts') if ' /workspace ' in l]))",
        )
        assert found == ["tmpfs"]
    finally:
        await session.shutdown()


# -- records read back are checked (pure: no engine) --------------------------------------------


@pytest.fixture
def state(tmp_path):
    use_state_dir(tmp_path / "state")
    yield tmp_path / "state"
    use_state_dir(None)


SID = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    "record",
    [
        {"session_id": "../../etc", "size_mb": 64, "uid": 5, "gid": 5},
        {"session_id": "/etc/shadow", "size_mb": 64, "uid": 5, "gid": 5},
        {"session_id": SID + "/..", "size_mb": 64, "uid": 5, "gid": 5},
        {"session_id": SID, "size_mb": "64", "uid": 5, "gid": 5},
        {"session_id": SID, "size_mb": 64, "uid": -1, "gid": 5},
        {"session_id": SID, "size_mb": 64, "uid": True, "gid": 5},
        {"session_id": SID, "size_mb": 64, "uid": 5, "gid": 5, "image": "/etc/shadow"},
        {"session_id": SID, "size_mb": 64, "uid": 5},
        {"session_id": SID, "size_mb": 64, "uid": 5, "gid": 5, "mount_point": "/"},
        "not an object",
    ],
    ids=[
        "dotdot",
        "absolute",
        "slash",
        "size-string",
        "uid-negative",
        "uid-bool",
        "image-elsewhere",
        "no-gid",
        "mount-root",
        "str",
    ],
)
def test_a_tampered_record_is_refused(state, record):
    with pytest.raises(AdoptionRefusedError):
        WorkspaceDisk.from_dict(record)


def test_a_record_round_trips_and_names_only_the_state_dir(state):
    disk = WorkspaceDisk(SID, 64, 1879048200, 10001)
    again = WorkspaceDisk.from_dict(json.loads(json.dumps(disk.to_dict())))
    assert again == disk
    assert disk.image == state / "workspaces" / f"{SID}.img"
    assert disk.mount_point.parent == disk.image.parent


def test_an_image_that_is_a_symlink_is_refused_and_its_target_untouched(state, tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"x" * MIB)
    disk = WorkspaceDisk(SID, 1, 0, 0)
    disk.image.symlink_to(target)
    with pytest.raises(AdoptionRefusedError):
        disk.check_image()
    assert remove_workspace_disk(SID) is True  # the link goes, not what it points at
    assert target.read_bytes() == b"x" * MIB and not os.path.lexists(disk.image)


def test_a_missing_image_is_a_lost_sandbox(state):
    with pytest.raises(SandboxLostError):
        WorkspaceDisk(SID, 1, 0, 0).check_image()


def test_remove_refuses_a_session_id_that_is_not_hex(state, tmp_path):
    (tmp_path / "victim.img").write_text("keep")
    with pytest.raises(ConfigError):
        remove_workspace_disk("../../victim")
    assert (tmp_path / "victim.img").read_text() == "keep"


@needs_root
def test_create_ensure_mounted_remove_are_idempotent(state):
    disk = WorkspaceDisk.create(SID, 16, 1879048200, 10001)
    try:
        assert disk.is_mounted()
        assert os.listdir(disk.mount_point) == []  # no lost+found: the workspace starts empty
        disk.ensure_mounted()  # already mounted: nothing happens
        subprocess.run(["umount", str(disk.mount_point)], check=True)  # as after a host reboot
        assert not disk.is_mounted()
        WorkspaceDisk.open(SID, 16, 1879048200, 10001)
        assert disk.is_mounted()
    finally:
        disk.remove()
        disk.remove()
    assert_gone(disk)


@needs_root
def test_a_disk_is_removed_from_its_own_state_dir_after_the_process_switched_to_another(state, tmp_path):
    """In-process gateways (the tests') each switch the process's state dir: a disk made under
    one must still be unmounted and deleted there when another is current, not looked for under
    the current one (which left its mount behind, and the next clean-up failed with EBUSY)."""
    disk = WorkspaceDisk.create(SID, 16, 1879048200, 10001)
    use_state_dir(tmp_path / "another-gateways-state")
    try:
        assert disk.mount_point.parent == state / "workspaces" and disk.is_mounted()
    finally:
        disk.remove()
    assert_gone(disk)
    assert mount_source(state / "workspaces" / f"{SID}.mnt") is None


@needs_root
def test_a_disk_set_up_through_a_mount_that_is_gone_is_still_recognised_and_removed(state, tmp_path):
    """As after a gateway container is replaced (a restart, a rolling upgrade): it had opened the
    image through its own bind mount of the state dir, which went with it, so the kernel names the
    loop's backing file from that detached mount ("/<id>.img"). The disk is still the session's:
    the next gateway must adopt it, and remove it when the session ends."""
    disk = WorkspaceDisk.create(SID, 16, 1879048200, 10001)
    view = tmp_path / "old-gateway-view"
    view.mkdir()
    try:
        subprocess.run(["umount", str(disk.mount_point)], check=True)
        subprocess.run(["mount", "--bind", str(disk.image.parent), str(view)], check=True)
        subprocess.run(["mount", "-o", "loop,nosuid,nodev", str(view / disk.image.name), str(disk.mount_point)],
                       check=True)  # fmt: skip
        subprocess.run(["umount", "-l", str(view)], check=True)
        device = mount_source(disk.mount_point)
        assert loop_backing_file(device) != str(disk.image)  # what the old path check compared
        assert disk.is_mounted()
    finally:
        disk.remove()
    assert_gone(disk)


def test_a_loop_device_backed_by_another_file_is_not_taken_for_the_disk(state, tmp_path):
    other = tmp_path / "other.img"
    other.write_bytes(b"")
    assert not loop_backs("/dev/loop0", state / "missing.img")
    assert not loop_backs("/dev/null", other)  # not a loop device at all
    assert not loop_backs("/etc/passwd", other)


# -- the setting ------------------------------------------------------------------------------


def test_a_tenant_may_choose_either_storage_and_nothing_else():
    catalog = ProfileCatalog.load(default_runtime=Runtime.RUNSC)
    assert catalog.profile("default").workspace_storage is WorkspaceStorage.DISK
    assert catalog.describe()["default"]["defaults"]["workspace_storage"] == "disk"
    chosen = catalog.for_tenant("default", {"workspace_storage": "memory"})
    assert chosen.workspace_storage is WorkspaceStorage.MEMORY
    for bad in ("tmpfs", "", None, ["disk"], {"disk": 1}):
        with pytest.raises(ConfigError, match="workspace_storage must be one of"):
            catalog.for_tenant("default", {"workspace_storage": bad})


NOT_ROOT_PROBE = """
import json, os, sys
from sandkernel.errors import ConfigError
from sandkernel.kernels.sandbox.workspace_disk import WorkspaceDisk, disk_support
os.setgid(65534); os.setuid(65534)  # after the imports: the interpreter may live under /root
try:
    WorkspaceDisk.create("ab" * 16, 8, 1879048200, 10001)
    print(json.dumps({"created": True}))
except ConfigError as err:
    print(json.dumps({"support": disk_support(), "error": str(err)}))
"""


@needs_root
def test_not_root_gets_a_clear_error_that_names_the_memory_workspace(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    env = dict(os.environ, SANDKERNEL_STATE_DIR=str(state))
    done = subprocess.run([sys.executable, "-c", NOT_ROOT_PROBE], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["support"][0] is False
    assert 'workspace_storage "memory"' in found["error"] and "root" in found["error"]
    assert os.listdir(state) == []  # nothing made


@needs_root
@pytest.mark.parametrize("runtime", [RUNC])
async def test_a_workspace_bigger_than_the_hosts_free_disk_is_refused_and_leaves_nothing(runtime, tmp_path):
    use_state_dir(tmp_path / "state")
    try:
        free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize // MIB
        if free >= 262144:
            pytest.skip(f"the host has {free} MiB free, more than the largest workspace_mb")
        # the disk is made before the container, so nothing else exists yet (the suite's end-of-run
        # check fails the run if a container was left behind)
        with pytest.raises(KernelStartError, match="MiB free"):
            await start(runtime, workspace_mb=262144)
        assert os.listdir(tmp_path / "state" / "workspaces") == []
    finally:
        use_state_dir(None)


@needs_root
def test_the_sweep_removes_only_disks_no_one_holds(state):
    """Kept: catalogued/containered ids, and disks of live owners (a process between making a
    disk and its container). Swept: dead or unrecorded owners."""
    ids = {name: digit * 32 for name, digit in (("alive", "a"), ("dead", "d"), ("unrecorded", "0"), ("kept", "c"))}
    owners = {"alive": "host:1:alive", "dead": "host:2:dead", "unrecorded": "", "kept": "host:3:dead"}
    disks: dict[str, WorkspaceDisk] = {}
    try:
        for name in ids:  # one by one: whatever was made is removed in finally
            disks[name] = WorkspaceDisk.create(ids[name], 8, 1879048200, 10001, owners[name])
        assert disks["alive"].owner() == "host:1:alive" and disks["unrecorded"].owner() is None
        swept = sweep_workspace_disks({ids["kept"]}, lambda owner: owner.endswith(":alive"))
        assert sorted(swept) == sorted([ids["dead"], ids["unrecorded"]])
        for name in ("dead", "unrecorded"):
            assert_gone(disks[name])
            assert not os.path.lexists(disks[name].owner_file)
        for name in ("alive", "kept"):
            assert disks[name].is_mounted()
    finally:
        for disk in disks.values():
            disk.remove()
    assert leftover_session_ids() == []


@needs_root
def test_a_disk_copied_while_mounted_and_one_released_come_back_whole_and_the_original_is_thawed(state, tmp_path):
    """copy_image (a fork) freezes the filesystem for the copy and thaws it; release_image (a
    pause) trims, unmounts and moves the image; from_image mounts a kept image for another
    session. The files are there in each, and each disk is its own."""
    other = "0" * 31 + "1"
    disk = WorkspaceDisk.create(SID, 64, 0, 0)
    try:
        (disk.mount_point / "notes.txt").write_text("kept")
        os.sync()
        base = disk.allocated_bytes()
        (disk.mount_point / "gone.bin").write_bytes(os.urandom(8 * MIB))
        os.sync()
        assert disk.allocated_bytes() >= base + 8 * MIB
        copy = tmp_path / "copy.img"
        disk.copy_image(copy)
        (disk.mount_point / "after.txt").write_text("written after the copy")  # thawed: writes go on
        copied = WorkspaceDisk.from_image(other, copy, 64, 0, 0)
        try:
            assert not copy.exists()  # moved into place
            assert (copied.mount_point / "notes.txt").read_text() == "kept"
            assert not (copied.mount_point / "after.txt").exists()
        finally:
            copied.remove()
        (disk.mount_point / "gone.bin").unlink()
        kept = tmp_path / "kept.img"
        disk.release_image(kept)
        assert not disk.is_mounted() and not os.path.lexists(disk.image) and not loop_devices_of(str(kept))
        assert kept.stat().st_blocks * 512 < base + MIB  # the deleted file's blocks were trimmed out
        with pytest.raises(KernelStartError):  # another size than the profile's: refused
            WorkspaceDisk.from_image(SID, kept, 32, 0, 0)
        again = WorkspaceDisk.from_image(SID, kept, 64, 0, 0)
        assert (again.mount_point / "after.txt").read_text() == "written after the copy"
    finally:
        disk.remove()
    assert_gone(disk)
