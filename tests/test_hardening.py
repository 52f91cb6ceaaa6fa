"""Hardening by default: each setting is checked on the running container (docker inspect)
AND probed from inside the kernel, under runc and under gVisor."""

from __future__ import annotations

import json
import os
import time

import pytest

from sandkernel.kernels.sandbox import cgroup
from sandkernel.kernels.sandbox.container import SANDBOX_UID_RANGE, host_pids_limit
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.runtime_dir import CONTAINER_DIR

pytestmark = pytest.mark.docker


async def probe(session, code: str):
    """Run code that prints one JSON document and return it decoded."""
    result = await session.execute(code, timeout=60)
    assert result.status.value == "ok", result.text + str(result.error)
    return json.loads(result.text.strip().splitlines()[-1])


@pytest.fixture
def inspected(kernel_session):
    return default_engine().client.api.inspect_container(kernel_session.container.id)


async def test_only_loopback_network(kernel_session, inspected):
    assert inspected["HostConfig"]["NetworkMode"] == "none"
    assert inspected["NetworkSettings"]["Ports"] in ({}, None)
    found = await probe(
        kernel_session,
        "import socket, json\nprint(json.dumps([n for _, n in socket.if_nameindex()]))",
    )
    assert found == ["lo"]


async def test_root_is_read_only_and_tmpfs_are_capped(kernel_session, inspected):
    assert inspected["HostConfig"]["ReadonlyRootfs"] is True
    tmpfs = inspected["HostConfig"]["Tmpfs"]
    assert "size=64m" not in tmpfs["/tmp"] and f"size={kernel_session.profile.tmp_mb}m" in tmpfs["/tmp"]
    # /workspace is the session's own disk image (its cap: tests/test_workspace_disk.py)
    assert "/workspace" not in tmpfs
    disk = kernel_session._kernel.provisioner.workspace_disk
    assert [m["Source"] for m in inspected["Mounts"] if m["Destination"] == "/workspace"] == [str(disk.mount_point)]
    found = await probe(
        kernel_session,
        """import os, json
out = {}
for path in ["/etc/x", "/usr/x", "/opt/kernel/x", "/x"]:
    try:
        open(path, "w"); out[path] = "written"
    except OSError as e:
        out[path] = e.strerror
for path in ["/tmp", "/workspace"]:
    st = os.statvfs(path); out[path] = st.f_blocks * st.f_frsize // 2**20
print(json.dumps(out))""",
    )
    for path in ["/etc/x", "/usr/x", "/opt/kernel/x", "/x"]:
        assert found[path] in ("Read-only file system", "Permission denied"), found
    assert found["/tmp"] <= kernel_session.profile.tmp_mb
    assert found["/workspace"] <= kernel_session.profile.workspace_mb


async def test_tmp_fills_up_at_its_cap_not_the_host(kernel_session):
    result = await kernel_session.execute(
        """import os
try:
    with open('/tmp/fill', 'wb') as f:
        for _ in range(10000):
            f.write(b'x' * 2**20)
except OSError as e:
    print('stopped:', e.strerror, os.path.getsize('/tmp/fill') // 2**20)
finally:
    os.unlink('/tmp/fill')""",
        timeout=60,
    )
    assert "stopped: No space left on device" in result.text, result.text
    assert int(result.text.split()[-1]) <= kernel_session.profile.tmp_mb


async def test_unprivileged_no_caps_no_new_privs_seccomp(kernel_session, inspected):
    uid, gid = (int(part) for part in inspected["Config"]["User"].split(":"))
    assert SANDBOX_UID_RANGE[0] <= uid < SANDBOX_UID_RANGE[1] and gid == 10001  # a host uid of its own
    assert inspected["Config"]["Labels"]["sandkernel.uid"] == str(uid)
    assert inspected["HostConfig"]["CapDrop"] == ["ALL"] and not inspected["HostConfig"]["CapAdd"]
    security = inspected["HostConfig"]["SecurityOpt"]
    assert "no-new-privileges:true" in security
    seccomp = [opt for opt in security if opt.startswith("seccomp=")]
    assert seccomp and "unconfined" not in seccomp[0]
    assert json.loads(seccomp[0][len("seccomp=") :])["syscalls"], "the profile must deny something"
    assert inspected["HostConfig"]["Privileged"] is False
    found = await probe(
        kernel_session,
        """import ctypes, os, json
status = dict(line.split(':\\t', 1) for line in open('/proc/self/status').read().splitlines() if ':\\t' in line)
found = {k: status.get(k, '').strip() for k in ['Uid', 'CapEff', 'CapPrm', 'CapBnd']}
libc = ctypes.CDLL(None)
found['NoNewPrivs'] = libc.prctl(39, 0, 0, 0, 0)  # PR_GET_NO_NEW_PRIVS
found['Seccomp'] = libc.prctl(21, 0, 0, 0, 0)  # PR_GET_SECCOMP: 2 means a filter is installed
print(json.dumps(found))""",
    )
    assert found["Uid"].split()[0] == str(uid) and found["Uid"].split()[0] != "0"
    assert int(found["CapEff"], 16) == 0 and int(found["CapPrm"], 16) == 0 and int(found["CapBnd"], 16) == 0
    assert found["NoNewPrivs"] == 1
    assert found["Seccomp"] == 2


async def test_seccomp_denies_namespaces_and_io_uring(kernel_session):
    found = await probe(
        kernel_session,
        """import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
out = {}
for name, call in {
    "unshare_user": lambda: libc.unshare(0x10000000),
    "io_uring_setup": lambda: libc.syscall(425, 1, ctypes.byref(ctypes.create_string_buffer(120))),
    "ptrace_attach_1": lambda: libc.ptrace(16, 1, None, None),
}.items():
    ret = call(); out[name] = [ret, errno.errorcode.get(ctypes.get_errno(), '?')]
import socket
try:
    socket.socket(40, socket.SOCK_STREAM); out["vsock"] = "created"
except OSError as e:
    out["vsock"] = errno.errorcode.get(e.errno, '?')
print(json.dumps(out))""",
    )
    for name in ["unshare_user", "io_uring_setup", "ptrace_attach_1"]:
        assert found[name][0] == -1, found
        assert found[name][1] in ("EPERM", "ENOSYS", "EINVAL", "EACCES"), found
    assert found["vsock"] != "created"


async def test_pids_memory_cpu_limits(kernel_session, inspected):
    host = inspected["HostConfig"]
    assert host["PidsLimit"] == host_pids_limit(kernel_session.profile)
    assert host["Memory"] == 512 * 2**20 and host["MemorySwap"] == host["Memory"]
    assert host["NanoCpus"] == int(0.5 * 1e9)
    if kernel_session.profile.runtime.value == "runsc":
        await _gvisor_pids_are_bounded(kernel_session)
    else:
        await _runc_threads_are_bounded(kernel_session)
    # cpu: two busy processes for 1.5 s of wall time get about 0.5 cores between them. The host's
    # count (the container's cgroup, over the probe's wall time on the host) is the measure under
    # both runtimes; under runc the guest's own count agrees. gVisor's guest clock is no CPU count:
    # on the ptrace platform it includes host preemption, so a loaded machine inflates it.
    group = cgroup.locate(kernel_session.container.id)
    assert group is not None, "the container's cgroup is not found"
    before, began = group.cpu_times(), time.monotonic()
    found = await probe(
        kernel_session,
        """import json, multiprocessing as mp, os, time
def spin(deadline):
    while time.time() < deadline: pass
deadline = time.time() + 1.5
ps = [mp.Process(target=spin, args=(deadline,)) for _ in range(2)]
[p.start() for p in ps]; [p.join() for p in ps]
t = os.times(); print(json.dumps({"cpu": t.children_user + t.children_system}))""",
    )
    used, wall = group.cpu_times().since(before).total, time.monotonic() - began
    group.close()
    assert used < max(wall, 1.5) * 0.5 * 1.6, (used, wall)  # unlimited would be ~2 per second of wall
    if kernel_session.profile.runtime.value == "runc":
        assert found["cpu"] < 1.5 * 0.5 * 1.6, found  # unlimited would be ~3.0 on two cores


async def _runc_threads_are_bounded(session):
    """The kernel cannot start more threads than the pids limit allows."""
    found = await probe(
        session,
        """import threading, json, time
stop = threading.Event(); threads = []
try:
    for _ in range(400):
        t = threading.Thread(target=stop.wait); t.start(); threads.append(t)
except RuntimeError:
    pass
started = len(threads); stop.set(); [t.join() for t in threads]
print(json.dumps({"threads": started}))""",
    )
    assert 0 < found["threads"] < 128


async def _gvisor_pids_are_bounded(session):
    """Under gVisor, forking past the host limit either fails in the guest or ends the sandbox."""
    limit = host_pids_limit(session.profile)
    result = await session.execute(
        f"""import os, time
n = 0
try:
    for _ in range({limit + 50}):
        if os.fork() == 0:
            time.sleep(30); os._exit(0)
        n += 1
except OSError as e:
    print('fork failed after', n, e.strerror)
""",
        timeout=60,
    )
    if result.status.value == "ok":
        assert "fork failed after" in result.text, result.text
        assert int(result.text.split()[3]) < limit + 50
    else:
        assert result.status.value in ("kernel_died", "oom"), result.status
    after = await session.execute("print('alive')", timeout=60)
    assert after.text == "alive\n"


async def test_ulimits(kernel_session, inspected):
    limits = {u["Name"]: (u["Soft"], u["Hard"]) for u in inspected["HostConfig"]["Ulimits"]}
    fsize = kernel_session.profile.fsize_mb * 2**20
    assert limits == {"nofile": (1024, 1024), "core": (0, 0), "fsize": (fsize, fsize)}
    found = await probe(
        kernel_session,
        """import resource, json
print(json.dumps({n: resource.getrlimit(getattr(resource, 'RLIMIT_' + n.upper())) for n in ['nofile', 'core', 'fsize']}))""",
    )
    assert found == {"nofile": [1024, 1024], "core": [0, 0], "fsize": [fsize, fsize]}


async def test_no_docker_socket_and_no_writable_host_path(kernel_session, inspected):
    binds = inspected["HostConfig"]["Binds"] or []
    mounts = inspected["Mounts"]
    # the runtime dir, and the session's own workspace disk (nothing else of the host's)
    assert sorted(m["Destination"] for m in mounts if m["Type"] == "bind") == sorted([CONTAINER_DIR, "/workspace"])
    assert not any("docker.sock" in b or "containerd" in b for b in binds)
    assert inspected["HostConfig"]["IpcMode"] == "private"
    assert inspected["HostConfig"]["LogConfig"]["Config"].get("max-size") == "1m"
    found = await probe(
        kernel_session,
        """import os, json
socks = [p for p in ['/var/run/docker.sock', '/run/docker.sock', '/run/containerd/containerd.sock'] if os.path.exists(p)]
writable = []
for line in open('/proc/self/mountinfo'):
    fields = line.split(); target, opts = fields[4], fields[5]
    fstype = fields[fields.index('-') + 1]
    if 'rw' in opts.split(',') and fstype not in ('tmpfs', 'proc', 'sysfs', 'devpts', 'mqueue', 'cgroup', 'cgroup2', 'devtmpfs'):
        if os.access(target, os.W_OK):
            writable.append(target)
print(json.dumps({"sockets": socks, "writable": writable, "rundir_writable": os.access('/run/sandkernel', os.W_OK)}))""",
    )
    assert found["sockets"] == []
    assert set(found["writable"]) <= {CONTAINER_DIR, "/workspace"}, found
    assert found["rundir_writable"] is False, "the runtime dir must be locked once the kernel has bound"


async def test_no_secrets_in_kernel_environment(kernel_session):
    os.environ["SANDKERNEL_TEST_SECRET"] = "hunter2"  # set on the host after start: must not leak on restart
    try:
        await kernel_session.restart()
        found = await probe(kernel_session, "import os, json\nprint(json.dumps(dict(os.environ)))")
    finally:
        del os.environ["SANDKERNEL_TEST_SECRET"]
    assert "hunter2" not in json.dumps(found)
    host_only = {"SANDKERNEL_TEST_SECRET", "ANTHROPIC_API_KEY", "SANDKERNEL_TOKEN", "DOCKER_HOST", "PYENV_ROOT"}
    assert not host_only & set(found)
    assert found["HOME"] == "/workspace"
    assert not any(key.endswith(("_KEY", "_TOKEN", "_SECRET", "PASSWORD")) for key in found)


async def test_labels_and_runtime(kernel_session, inspected):
    labels = inspected["Config"]["Labels"]
    assert labels["sandkernel.session"] == kernel_session.id
    assert labels["sandkernel.kernel"] == kernel_session.kernel_id
    assert labels["sandkernel.owner"]
    assert inspected["HostConfig"]["Runtime"] == kernel_session.profile.runtime.value
