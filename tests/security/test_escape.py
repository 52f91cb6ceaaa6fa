"""Escape probes from inside the kernel: each case is a real attempt, made as the attacker's
code, and must fail for the reason that matters. Each call gets arguments valid enough that the
only thing left to refuse it is the permission check or the seccomp filter: a refusal that
comes from a bad pointer or a missing file (EFAULT, EBADF, ENOENT, EINVAL) would prove nothing.
So every case names exactly one outcome per runtime; where runc and gVisor differ, both are
written down with the reason (gVisor refuses writes it does not implement with EACCES where
Linux says EROFS, and lacks some kernel objects altogether). "succeeded" is never accepted.

Syscalls the seccomp profile denies by name (kernels/sandbox/seccomp.py DENIED_SYSCALLS) answer EPERM in
both runtimes: the kernel installs the filter on itself, and under runc it also stacks on
Docker's copy. Several cases would succeed for an unprivileged process without the filter
(perf_event_open, bpf map, io_uring, add_key, userfaultfd on some hosts, process_vm_readv of
itself): for those, EPERM is the filter's answer and nothing else's."""

from __future__ import annotations

import errno
import json
import platform
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sandkernel.kernels.sandbox.seccomp import AF_VSOCK, seccomp_profile

pytestmark = [pytest.mark.security, pytest.mark.docker]

HARNESS = """import ctypes, errno, json, os, socket, struct, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
U = ctypes.c_ulong
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
def in_child(fn):
    # unshare(CLONE_NEWUSER) and CLONE_FS refuse a multithreaded caller with EINVAL before any
    # permission check; the kernel process has threads, a fresh fork has one.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, outcome(fn).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return f.read()
def write(path, data="x"):
    with open(path, "w") as f:
        f.write(data)
def perf_attr():
    # PERF_TYPE_SOFTWARE / CPU_CLOCK, disabled, exclude_kernel, exclude_hv: what perf_event_paranoid
    # 2 lets any user open for its own process
    attr = ctypes.create_string_buffer(112)
    struct.pack_into('=IIQ', attr, 0, 1, 112, 0)
    struct.pack_into('=Q', attr, 40, 1 | (1 << 5) | (1 << 6))
    return attr
def bpf_map_attr():
    attr = ctypes.create_string_buffer(120)
    struct.pack_into('=IIII', attr, 0, 2, 4, 4, 1)  # BPF_MAP_TYPE_ARRAY, key 4, value 4, 1 entry
    return attr
def swapfile():
    with open('/tmp/swap', 'wb') as f:
        f.write(bytes(65536))
    return b'/tmp/swap'
MODULE = ctypes.create_string_buffer(b'\\x7fELF' + bytes(60))
LOCAL = ctypes.create_string_buffer(64)
IOV = (ctypes.c_void_p * 2)(ctypes.addressof(LOCAL), 64)
"""

DENIED = "EPERM"  # the answer of a permission check and of the seccomp filter's named denials


def profile_default_for(name: str) -> str | None:
    """The errno the seccomp profile answers for a syscall it neither allows nor denies by name
    (an allow-list's default), or None when the profile lets the call reach the kernel."""
    profile = seccomp_profile()
    named = {n for rule in profile["syscalls"] for n in rule["names"] if not rule.get("args")}
    if profile["defaultAction"] == "SCMP_ACT_ALLOW" or name in named:
        return None
    return errno.errorcode[profile.get("defaultErrnoRet", errno.EPERM)]


# name: (the attempt, as an expression for outcome(lambda: ...), the outcome: one string for both
# runtimes, or {"runc": ..., "runsc": ...})
CASES: dict[str, tuple[str, str | dict[str, str]]] = {
    # become root
    "setuid_0": ("os.setuid(0)", DENIED),
    "setgid_0": ("os.setgid(0)", DENIED),
    "setgroups_root": ("os.setgroups([0])", DENIED),
    "capset_all": (
        "libc.syscall(126, ctypes.byref((ctypes.c_uint32 * 2)(0x20080522, 0)), "
        "ctypes.byref((ctypes.c_uint32 * 6)(*[0xffffffff] * 6)))",
        DENIED,
    ),
    # mount and namespaces
    "mount_tmpfs": ("libc.mount(b'none', b'/tmp', b'tmpfs', U(0), None)", DENIED),
    "mount_cgroup_release_agent": ("libc.mount(b'cgroup', b'/tmp', b'cgroup', U(0), b'rdma')", DENIED),
    "unshare_user_ns": ("in_child(lambda: libc.unshare(0x10000000))", DENIED),
    "unshare_mount_ns": ("in_child(lambda: libc.unshare(0x00020000))", DENIED),
    "unshare_net_ns": ("in_child(lambda: libc.unshare(0x40000000))", DENIED),
    # the sandbox's own net namespace: a file that exists under both runtimes (gVisor has no ns/mnt)
    "setns_own_net_ns": ("libc.setns(os.open('/proc/self/ns/net', os.O_RDONLY), 0x40000000)", DENIED),
    "chroot": ("os.chroot('/tmp')", DENIED),
    "pivot_root": ("libc.syscall(155, b'/tmp', b'/tmp')", DENIED),
    # other processes
    "ptrace_attach_pid1": ("libc.ptrace(16, 1, None, None)", DENIED),
    # its own memory, with valid buffers: without the filter this succeeds
    "process_vm_readv_self": ("libc.syscall(310, os.getpid(), IOV, 1, IOV, 1, 0)", DENIED),
    # the kernel's knobs: gVisor answers writes to its read-only /proc and /sys with EACCES
    "write_proc_sys_hostname": ("write('/proc/sys/kernel/hostname', 'pwned')", {"runc": "EROFS", "runsc": "EACCES"}),
    # runc masks /proc/sysrq-trigger (absent); gVisor has a read-only one
    "write_sysrq_trigger": ("write('/proc/sysrq-trigger', 'b')", {"runc": "ENOENT", "runsc": "EACCES"}),
    "write_core_pattern": ("write('/proc/sys/kernel/core_pattern', '|/tmp/x')", {"runc": "EROFS", "runsc": "EACCES"}),
    "write_uevent_helper": ("write('/sys/kernel/uevent_helper', '/tmp/x')", {"runc": "EROFS", "runsc": "EACCES"}),
    "init_module": ("libc.syscall(175, MODULE, U(64), b'')", DENIED),
    "finit_module": ("libc.syscall(313, os.open('/etc/hostname', os.O_RDONLY), b'', 0)", DENIED),
    "delete_module": ("libc.syscall(176, b'ext4', 0o4000)", DENIED),
    "kexec_load": ("libc.syscall(246, U(0), U(0), None, U(0))", DENIED),
    "reboot": ("libc.syscall(169, 0xfee1dead, 672274793, 0x1234567, None)", DENIED),
    "swapon": ("libc.syscall(167, swapfile(), 0)", DENIED),
    "syslog_read_dmesg": ("libc.syscall(103, 3, ctypes.create_string_buffer(4096), 4096)", DENIED),
    "clock_settime": ("libc.clock_settime(0, ctypes.byref((ctypes.c_long * 2)(0, 0)))", DENIED),
    # not on Docker's allow-list nor denied by name: an allow-list profile answers its default
    "sethostname": ("libc.sethostname(b'pwned', U(5))", profile_default_for("sethostname") or DENIED),
    "iopl": ("libc.syscall(172, 3)", DENIED),
    "acct": ("libc.syscall(163, b'/tmp/acct')", DENIED),
    # devices and dangerous kernel interfaces
    "open_dev_mem": ("open('/dev/mem', 'rb')", "ENOENT"),  # no such device in the sandbox at all
    "open_by_handle_at": ("libc.syscall(304, -100, ctypes.create_string_buffer(64), 0)", DENIED),
    "bpf_map_create": ("libc.syscall(321, 0, bpf_map_attr(), 120)", DENIED),
    "perf_event_open_self": ("libc.syscall(298, perf_attr(), 0, -1, -1, U(0))", DENIED),
    "userfaultfd": ("libc.syscall(323, 0)", DENIED),
    "io_uring_setup": ("libc.syscall(425, 1, ctypes.create_string_buffer(120))", DENIED),
    "add_key": ("libc.syscall(248, b'user', b'k', b'v', 1, -2)", DENIED),
    # reaching the engine: the sockets are not there
    "docker_sock": ("socket.socket(socket.AF_UNIX).connect('/var/run/docker.sock')", "ENOENT"),
    "docker_sock_run": ("socket.socket(socket.AF_UNIX).connect('/run/docker.sock')", "ENOENT"),
    "containerd_sock": ("socket.socket(socket.AF_UNIX).connect('/run/containerd/containerd.sock')", "ENOENT"),
    # files that are not ours: root-owned, and (runc) a read-only root; gVisor checks permission first
    "read_etc_shadow": ("open('/etc/shadow').read()", "EACCES"),
    "write_etc_passwd": ("write('/etc/passwd', 'root::0:0::/:/bin/sh')", {"runc": "EROFS", "runsc": "EACCES"}),
    # Python turns setrlimit's EPERM into "ValueError: not allowed to raise maximum limit"
    "raise_nofile_hard_limit": (
        "__import__('resource').setrlimit(__import__('resource').RLIMIT_NOFILE, (1 << 20, 1 << 20))",
        "ValueError",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
async def test_escape_attempt_fails(arena, name):
    attempt, expected = CASES[name]
    if isinstance(expected, dict):
        expected = expected[arena.runtime]
    found = await arena.probe(f"{HARNESS}\nprint(json.dumps(outcome(lambda: {attempt})))")
    assert found == expected, f"{name} under {arena.runtime}: {found}, expected {expected}"


async def test_no_capability_exists_to_raise(arena):
    """Every capability set is empty and no_new_privs is set, so raising an ambient capability
    has nothing to raise: Linux answers EPERM. gVisor (up to at least 2022-12) has no ambient set
    (no CapAmb line in /proc/self/status) and answers PR_CAP_AMBIENT with EINVAL; should a newer
    gVisor add it, the expectation becomes Linux's EPERM."""
    found = await arena.probe(
        f"""{HARNESS}
status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if l.startswith('Cap'))
print(json.dumps({{'caps': {{k: v.strip() for k, v in status.items()}},
                  'no_new_privs': libc.prctl(39, U(0), U(0), U(0), U(0)),
                  'raise_ambient': outcome(lambda: libc.prctl(47, U(2), U(21), U(0), U(0)))}}))"""
    )
    assert found["caps"] and set(found["caps"].values()) == {"0000000000000000"}, found
    assert found["no_new_privs"] == 1, found
    linux_like = arena.runtime == "runc" or "CapAmb" in found["caps"]
    assert found["raise_ambient"] == ("EPERM" if linux_like else "EINVAL"), found


async def test_setuid_binaries_grant_nothing(arena):
    """sudo is not in the image, and the setuid-root binaries that are (su, mount, passwd...:
    Debian's base) run with the caller's uid and no capability: no-new-privileges makes the
    kernel ignore the setuid bit. Proved on su, which stays alive at its password prompt, by
    reading its credentials while it waits (a real setuid su holds euid 0 at that point)."""
    found = await arena.probe(
        """import json, os, pty, select, shutil, stat, time
setuid = []
for root, dirs, files in os.walk('/'):
    if root in ('/proc', '/sys', '/dev'):
        dirs[:] = []
        continue
    for name in files:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o6000:
            setuid.append(path)
out = {'sudo': shutil.which('sudo') or os.path.lexists('/usr/bin/sudo'), 'setuid': sorted(setuid), 'uid': os.getuid()}
if '/usr/bin/su' in setuid:
    pid, fd = pty.fork()
    if pid == 0:
        os.execv('/usr/bin/su', ['su', 'root', '-c', 'id'])
    seen, end = b'', time.monotonic() + 20
    while b'assword' not in seen and time.monotonic() < end:
        if select.select([fd], [], [], 0.5)[0]:
            seen += os.read(fd, 1024)
    out['su_prompt'] = seen.decode(errors='replace').strip()
    out['su_creds'] = {l.split(':')[0]: l.split(':')[1].split() for l in open(f'/proc/{pid}/status')
                       if l.startswith(('Uid:', 'Gid:', 'CapEff:', 'CapPrm:'))}
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(json.dumps(out))"""
    )
    assert found["sudo"] is False, found
    if not found["setuid"]:
        return  # nothing in the image could raise privileges even without no-new-privileges
    assert "/usr/bin/su" in found["setuid"], found  # the binary the proof below runs
    assert found["su_prompt"] == "Password:", found
    creds = found["su_creds"]
    assert creds["Uid"] == [str(found["uid"])] * 4, f"setuid su changed uid: {creds}"
    assert creds["CapEff"] == creds["CapPrm"] == ["0000000000000000"], creds


async def test_mount_binary_mounts_nothing(arena):
    """The setuid mount binary, asked for a tmpfs: refused with its own message and exit status
    32 (mount failure), and the mount table is byte for byte what it was (the syscall itself is
    refused too: the mount_tmpfs case)."""
    found = await arena.probe(
        """import json, subprocess
before = open('/proc/self/mountinfo').read()
done = subprocess.run(['mount', '-t', 'tmpfs', 'none', '/tmp'], capture_output=True, text=True, timeout=20)
print(json.dumps({'code': done.returncode, 'stderr': done.stderr, 'same': open('/proc/self/mountinfo').read() == before}))"""
    )
    assert found["code"] == 32 and found["same"] is True, found
    assert found["stderr"].startswith("mount: /tmp: must be superuser to use mount."), found


async def test_cgroup_release_agent_is_out_of_reach(arena):
    """The release_agent escape needs a writable cgroup v1 hierarchy root. Under runc every
    cgroup filesystem the container sees is mounted read-only and is its own subtree, so no
    release_agent file exists in it and a real cgroup file there refuses writes (EROFS). Under
    gVisor no host cgroup is ever visible: the 2022 build mounts none (/sys/fs/cgroup is an empty
    read-only dir); the 2024 build (scripts/host-setup.sh pins it) mounts its own emulated
    cgroupfs, the sentry's, which has no release_agent file at all and refuses the sandbox user's
    writes (EACCES), with /sys/fs/cgroup itself read-only."""
    found = await arena.probe(
        f"""{HARNESS}
mounts = []
for line in open('/proc/self/mountinfo'):
    left, right = line.split(' - ')
    fstype = right.split()[0]
    if fstype in ('cgroup', 'cgroup2'):
        point, options = left.split()[4], left.split()[5].split(',')
        probe = 'notify_on_release' if fstype == 'cgroup' else 'cgroup.procs'
        mounts.append({{'point': point, 'fstype': fstype, 'ro': 'ro' in options,
                       'release_agent': os.path.lexists(point + '/release_agent'),
                       'write_release_agent': outcome(lambda: write(point + '/release_agent', '/tmp/x')),
                       'probe': probe, 'exists': os.path.exists(point + '/' + probe),
                       'write': outcome(lambda: write(point + '/' + probe, '1'))}})
top = os.listdir('/sys/fs/cgroup') if os.path.isdir('/sys/fs/cgroup') else None
print(json.dumps({{'mounts': mounts, 'top': top,
                  'write_top': outcome(lambda: write('/sys/fs/cgroup/release_agent', '/tmp/x'))}}))"""
    )
    if arena.runtime == "runc":
        assert found["mounts"], found
        for mount in found["mounts"]:
            assert mount["ro"] and not mount["release_agent"], mount
            assert mount["write_release_agent"] == "EROFS", mount
            assert mount["exists"] and mount["write"] == "EROFS", mount
    elif not found["mounts"]:  # the 2022 build
        assert found["top"] == [] and found["write_top"] == "EACCES", found
    else:  # the 2024 build's own cgroupfs
        for mount in found["mounts"]:
            assert not mount["release_agent"] and mount["write_release_agent"] == "EACCES", mount
            assert mount["write"] == "EACCES", mount
        assert found["write_top"] == "EROFS", found


def _host_socket_outcome(family: int) -> str:
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
    except OSError as err:
        return errno.errorcode.get(err.errno, str(err.errno))
    return "succeeded"


MARKER_ERRNO = errno.EDOM  # an errno no socket() call returns by itself
FILTER_CHECK = """import errno, json, socket, sys
sys.path.insert(0, sys.argv[1])
try:
    from seccomp_bpf import compile_profile, install
except ImportError:  # before the compiler had its own module
    from start_kernel import compile_profile, install
install(compile_profile(json.loads(sys.argv[2])))
out = {}
for name, family in (('vsock', 40), ('unix', socket.AF_UNIX)):
    try:
        socket.socket(family, socket.SOCK_STREAM).close(); out[name] = 'succeeded'
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(out))
"""


def compiled_filter_answers() -> dict[str, str]:
    """Install the kernel's own filter compiler's program (kernel-image/, what the image runs),
    built from the profile with the AF_VSOCK rule's errno swapped for a marker, in a child of this
    test process on the host kernel, and report what socket() answers there. The marker proves
    the compiled rule, not a missing address family, made the refusal."""
    profile = json.loads(json.dumps(seccomp_profile()))
    vsock_rules = [
        r
        for r in profile["syscalls"]
        if r["names"] == ["socket"]
        and r.get("action") == "SCMP_ACT_ERRNO"
        and [(a["index"], a["op"], a["value"]) for a in r.get("args", [])] == [(0, "SCMP_CMP_EQ", AF_VSOCK)]
    ]
    assert len(vsock_rules) == 1, f"the profile has no single AF_VSOCK denial: {profile['syscalls']}"
    assert vsock_rules[0]["errnoRet"] == errno.EAFNOSUPPORT
    vsock_rules[0]["errnoRet"] = MARKER_ERRNO
    image_dir = Path(__file__).resolve().parents[2] / "kernel-image"
    done = subprocess.run(
        [sys.executable, "-I", "-c", FILTER_CHECK, str(image_dir), json.dumps(profile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)


async def test_vsock_is_refused_by_the_filter(arena):
    """socket(AF_VSOCK) answers EAFNOSUPPORT in the sandbox; so does a kernel without vsock, so
    the errno alone proves nothing. Under runc the host kernel is the sandbox's: if the host
    opens a vsock socket (this test process does, unfiltered) and the sandbox cannot, the filter
    refused it. Under gVisor (no vsock of its own), or on a host without vsock, that comparison
    cannot tell, so the compiled filter itself is checked on the host kernel with a marker errno."""
    found = await arena.probe(f"{HARNESS}\nprint(json.dumps(outcome(lambda: socket.socket(40, socket.SOCK_STREAM))))")
    assert found == "EAFNOSUPPORT", found
    host = _host_socket_outcome(AF_VSOCK)
    if arena.runtime == "runc" and host != "EAFNOSUPPORT":
        assert host == "succeeded", host  # same kernel, different answer: the filter decided
        return
    assert platform.machine() == "x86_64", "the kernel's own filter exists only on x86_64: nothing refuses vsock here"
    assert compiled_filter_answers() == {"vsock": errno.errorcode[MARKER_ERRNO], "unix": "succeeded"}


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


async def test_an_orphan_is_reaped_by_init(arena):
    """A process whose parent exits is adopted by PID 1 (catatonit, or in a savable gVisor
    sandbox the kernel supervisor), which must collect it when it ends: a zombie left behind
    holds a slot of the sandbox's pids limit until the container goes."""
    found = await arena.probe(
        """import json, os, time
r, w = os.pipe()
child = os.fork()
if child == 0:
    grandchild = os.fork()
    if grandchild == 0:
        time.sleep(1)  # outlives its parent: adopted, then it ends
        os._exit(0)
    os.write(w, str(grandchild).encode())
    os._exit(0)
os.waitpid(child, 0)
grandchild = int(os.read(r, 32))

def state():
    try:
        fields = open(f'/proc/{grandchild}/stat').read().rsplit(')', 1)[1].split()
    except OSError:
        return None  # gone: reaped
    return [fields[0], int(fields[1])]

adopted = state()
deadline = time.monotonic() + 30
while state() is not None and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({'adopted': adopted, 'left': state()}))"""
    )
    assert found["adopted"] is not None and found["adopted"][1] == 1, found  # its parent is PID 1
    assert found["left"] is None, found  # a zombie ("Z") still there means PID 1 never collected it


async def test_device_nodes_reach_no_device(arena):
    """mknod of a block device: refused by Linux (no CAP_MKNOD). gVisor lets the node exist in
    its own in-memory tmpfs, but the tmpfs is nodev and gVisor has no host disks: opening it fails."""
    found = await arena.probe(
        f"""{HARNESS}
made = outcome(lambda: os.mknod('/tmp/sda', 0o60600, os.makedev(8, 0)))
opened = outcome(lambda: open('/tmp/sda', 'rb').read(512)) if made == 'succeeded' else None
print(json.dumps([made, opened]))"""
    )
    assert found == (["EPERM", None] if arena.runtime == "runc" else ["succeeded", "ENXIO"]), found


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
    # runc: PID 1's root is the container's own, where the file does not exist; gVisor refuses
    # /proc/1/root to the kernel outright
    through_pid1 = "ENOENT" if arena.runtime == "runc" else "EACCES"
    assert found[str(arena.sentinel)] == "ENOENT" and found["/proc/1/root" + str(arena.sentinel)] == through_pid1, found
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
