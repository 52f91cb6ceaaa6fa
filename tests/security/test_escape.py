"""Escape probes from inside the kernel: each case is a real attempt, made as the attacker's
code, and must fail. Where runc and gVisor refuse differently (gVisor does not implement some
calls, ENOSYS, or hides a file, ENOENT, where Linux says EPERM/EACCES/EROFS), the accepted
outcomes list both; "succeeded" is never accepted."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.security

HARNESS = """import ctypes, errno, json, os, socket, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def outcome(fn):
    ctypes.set_errno(0)
    try:
        ret = fn()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    except Exception as e:
        return type(e).__name__
    if isinstance(ret, str):
        return ret
    if isinstance(ret, int) and ret < 0:
        return errno.errorcode.get(ctypes.get_errno(), "?")
    return "succeeded"
def write(path, data="x"):
    with open(path, "w") as f:
        f.write(data)
def connect_unix(path):
    s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(path); s.close()
def shell(cmd):
    done = subprocess.run(cmd, shell=True, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=20)
    text = done.stdout + done.stderr
    return "succeeded" if done.returncode == 0 and "uid=0" in text else "refused"
"""

DENIED = {"EPERM", "EACCES"}
DENIED_OR_MISSING = DENIED | {"ENOSYS", "ENOENT", "EROFS", "EINVAL"}
READ_ONLY = {"EROFS", "EACCES", "EPERM", "ENOENT"}

# name: (the attempt, as an expression for outcome(lambda: ...), accepted outcomes)
CASES: dict[str, tuple[str, set[str]]] = {
    # become root
    "setuid_0": ("os.setuid(0)", DENIED),
    "setgid_0": ("os.setgid(0)", DENIED),
    "setgroups_root": ("os.setgroups([0])", DENIED),
    "su_root": ("shell('su -c id root')", {"refused"}),
    "sudo": ("shell('sudo -n id')", {"refused"}),
    "setuid_mount_binary": ("shell('mount -t tmpfs none /tmp && id')", {"refused"}),
    "raise_ambient_cap_sys_admin": ("libc.prctl(47, 2, 21, 0, 0)", DENIED | {"EINVAL"}),
    "capset_all": (
        "libc.syscall(126, ctypes.byref((ctypes.c_uint32 * 2)(0x20080522, 0)), "
        "ctypes.byref((ctypes.c_uint32 * 6)(*[0xffffffff] * 6)))",
        DENIED,
    ),
    # mount and namespaces
    "mount_tmpfs": ("libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)", DENIED),
    "mount_cgroup_release_agent": ("libc.mount(b'cgroup', b'/tmp', b'cgroup', 0, b'rdma')", DENIED),
    "unshare_user_ns": ("libc.unshare(0x10000000)", DENIED | {"EINVAL"}),
    "unshare_mount_ns": ("libc.unshare(0x00020000)", DENIED),
    "unshare_net_ns": ("libc.unshare(0x40000000)", DENIED),
    "setns_pid1_mnt": ("libc.setns(os.open('/proc/1/ns/mnt', os.O_RDONLY), 0)", DENIED_OR_MISSING),
    "chroot": ("os.chroot('/tmp')", DENIED),
    "pivot_root": ("libc.syscall(155, b'/tmp', b'/tmp')", DENIED | {"EINVAL"}),
    # other processes
    "ptrace_attach_pid1": ("libc.ptrace(16, 1, None, None)", DENIED),
    "process_vm_readv_pid1": ("libc.syscall(310, 1, None, 0, None, 0, 0)", DENIED | {"ENOSYS"}),
    # the kernel's knobs
    "write_proc_sys_hostname": ("write('/proc/sys/kernel/hostname', 'pwned')", READ_ONLY),
    "write_sysrq_trigger": ("write('/proc/sysrq-trigger', 'b')", READ_ONLY),
    "write_core_pattern": ("write('/proc/sys/kernel/core_pattern', '|/tmp/x')", READ_ONLY),
    "write_cgroup_release_agent": ("write('/sys/fs/cgroup/release_agent', '/tmp/x')", READ_ONLY),
    "write_uevent_helper": ("write('/sys/kernel/uevent_helper', '/tmp/x')", READ_ONLY),
    "init_module": ("libc.syscall(175, None, 0, b'')", DENIED | {"ENOSYS", "EFAULT"}),
    "finit_module": ("libc.syscall(313, 0, b'', 0)", DENIED | {"ENOSYS", "EBADF"}),
    "delete_module": ("libc.syscall(176, b'ext4', 0)", DENIED | {"ENOSYS"}),
    "kexec_load": ("libc.syscall(246, 0, 0, None, 0)", DENIED | {"ENOSYS"}),
    "reboot": ("libc.syscall(169, 0xfee1dead, 672274793, 0x1234567, None)", DENIED | {"ENOSYS"}),
    "swapon": ("libc.syscall(167, b'/tmp/swap', 0)", DENIED | {"ENOSYS", "ENOENT"}),
    "syslog_read_dmesg": ("libc.syscall(103, 3, ctypes.create_string_buffer(4096), 4096)", DENIED | {"ENOSYS"}),
    "clock_settime": ("libc.clock_settime(0, ctypes.byref((ctypes.c_long * 2)(0, 0)))", DENIED),
    "sethostname": ("libc.sethostname(b'pwned', 5)", DENIED),
    "iopl": ("libc.syscall(172, 3)", DENIED | {"ENOSYS"}),
    "acct": ("libc.syscall(163, b'/tmp/acct')", DENIED | {"ENOSYS"}),
    # devices and dangerous kernel interfaces
    "open_dev_mem": ("open('/dev/mem', 'rb')", DENIED_OR_MISSING),
    "open_by_handle_at": ("libc.syscall(304, -100, ctypes.create_string_buffer(64), 0)", DENIED | {"ENOSYS"}),
    "bpf": ("libc.syscall(321, 0, None, 0)", DENIED | {"ENOSYS"}),
    "perf_event_open": (
        "libc.syscall(298, ctypes.create_string_buffer(128), 0, -1, -1, 0)",
        DENIED | {"ENOSYS", "ENOENT", "ENODEV"},
    ),
    "userfaultfd": ("libc.syscall(323, 0)", DENIED | {"ENOSYS"}),
    "io_uring_setup": ("libc.syscall(425, 1, ctypes.create_string_buffer(120))", DENIED | {"ENOSYS"}),
    "add_key": ("libc.syscall(248, b'user', b'k', b'v', 1, -2)", DENIED | {"ENOSYS"}),
    "vsock_socket": ("socket.socket(40, socket.SOCK_STREAM)", DENIED | {"EAFNOSUPPORT", "EINVAL"}),
    # reaching the engine
    "docker_sock": ("connect_unix('/var/run/docker.sock')", {"ENOENT"}),
    "docker_sock_run": ("connect_unix('/run/docker.sock')", {"ENOENT"}),
    "containerd_sock": ("connect_unix('/run/containerd/containerd.sock')", {"ENOENT"}),
    # files that are not ours
    "read_etc_shadow": ("open('/etc/shadow').read()", {"EACCES", "ENOENT"}),
    "write_etc_passwd": ("write('/etc/passwd', 'root::0:0::/:/bin/sh')", READ_ONLY),
    "raise_nofile_hard_limit": (
        "__import__('resource').setrlimit(__import__('resource').RLIMIT_NOFILE, (1 << 20, 1 << 20))",
        {"ValueError", "EPERM"},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
async def test_escape_attempt_fails(arena, name):
    attempt, accepted = CASES[name]
    found = await arena.probe(f"{HARNESS}\nprint(json.dumps(outcome(lambda: {attempt})))")
    assert found != "succeeded" and found in accepted, f"{name} under {arena.runtime}: {found}"


async def test_sigkill_to_init_cannot_reach_beyond_the_sandbox(arena):
    """PID 1 (catatonit) runs as the sandbox's uid, so kill() is permitted. Linux never delivers
    SIGKILL to a pid namespace's init from inside it: the container lives on. gVisor delivers it
    and the attacker's own sandbox ends: reported as kernel_died, and the next execute gets a
    fresh container. Either way nothing outside the sandbox is touched (the arena checks)."""
    reply = await arena.attack(
        "import os\nos.kill(1, 9)\nimport time; time.sleep(1)\nprint(open('/proc/1/comm').read().strip())"
    )
    if arena.runtime == "runc":
        assert reply["status"] == "ok" and reply["text"].strip() == "catatonit"
    else:
        assert reply["status"] == "kernel_died", reply
        after = await arena.attack("print('fresh')")
        assert after["status"] == "ok" and after["text"] == "fresh\n" and after["state_lost"]


async def test_device_nodes_reach_no_device(arena):
    """mknod of a block device: refused by Linux (no CAP_MKNOD). gVisor lets the node exist in
    its own in-memory tmpfs, but the tmpfs is nodev and gVisor has no host disks: opening it fails."""
    found = await arena.probe(
        f"""{HARNESS}
made = outcome(lambda: os.mknod('/tmp/sda', 0o60600, os.makedev(8, 0)))
opened = outcome(lambda: open('/tmp/sda', 'rb').read(512)) if made == 'succeeded' else None
print(json.dumps([made, opened]))"""
    )
    made, opened = found
    if arena.runtime == "runc":
        assert made == "EPERM"
    else:
        assert made == "EPERM" or opened in DENIED_OR_MISSING | {"ENXIO", "ENODEV"}, found


async def test_host_files_are_out_of_reach(arena):
    """The host sentinel is invisible: directly, through /proc/1/root, or any /proc/*/root."""
    found = await arena.probe(
        f"""{HARNESS}
import glob
path = {str(arena.sentinel)!r}
seen = {{p: outcome(lambda p=p: open(p).read()) for p in [path, '/proc/1/root' + path]}}
seen['proc_roots'] = [r for r in glob.glob('/proc/*/root') if outcome(lambda r=r: open(r + path).read()) == 'succeeded']
print(json.dumps(seen))"""
    )
    assert found[str(arena.sentinel)] == "ENOENT" and found["/proc/1/root" + str(arena.sentinel)] in DENIED_OR_MISSING
    assert found["proc_roots"] == []


async def test_no_secret_in_env_files_or_processes(arena):
    """The gateway's tokens and the host's environment appear nowhere the kernel can read."""
    from ..gateway_fixtures import ALICE, BOB

    found = await arena.probe(
        f"""import json, os
# Written reversed, so this very code (kept in IPython's history) does not hold the needles.
needles = [t[::-1].encode() for t in {[ALICE[::-1], BOB[::-1]]!r}] + [b'PYENV_ROOT', b'SANDKERNEL_TOKEN', b'pytest']
hits, visible = [], []
for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
    for part in ('environ', 'cmdline'):
        try:
            data = open(f'/proc/{{pid}}/{{part}}', 'rb').read()
        except OSError:
            continue
        hits += [f'/proc/{{pid}}/{{part}}' for n in needles if n in data]
    try:
        visible.append(open(f'/proc/{{pid}}/comm').read().strip())
    except OSError:
        pass
for root in ['/workspace', '/tmp', '/run', '/opt/sandkernel', '/etc', '/home', '/root']:
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                if os.path.isfile(path) and os.path.getsize(path) < 2**20:
                    data = open(path, 'rb').read()
                    hits += [path for n in needles[:2] if n in data]
            except OSError:
                pass
print(json.dumps({{'hits': hits, 'processes': sorted(set(visible))}}))"""
    )
    assert found["hits"] == []
    # Only the sandbox's own processes are visible: no dockerd, containerd, pytest or host shell.
    assert not {"dockerd", "containerd", "pytest", "python3.11", "bash", "sshd"} & set(found["processes"])


async def test_only_sandbox_devices(arena):
    found = await arena.probe(
        """import json, os, stat
devices = {}
for name in os.listdir('/dev'):
    try:
        mode = os.lstat('/dev/' + name).st_mode
    except OSError:
        continue
    if stat.S_ISBLK(mode):
        devices[name] = 'block'
    elif stat.S_ISCHR(mode):
        devices[name] = 'char'
print(json.dumps(devices))"""
    )
    assert "block" not in found.values(), found
    allowed = {"null", "zero", "full", "random", "urandom", "tty", "ptmx", "console"}
    if arena.runtime == "runsc":
        allowed.add("fuse")  # gVisor's own FUSE device; mounting anything is still refused (mount_* cases)
    assert set(found) <= allowed, found
