"""The seccomp profile: an allow-list from Docker's default, our denials, ENOSYS for the rest.

Two kinds of evidence. On the host, a child process installs the BPF that the kernel image
compiles from ``kernels/sandbox/seccomp.py`` and then tries each call: the errnos come from the real
Linux seccomp code, independent of gVisor and of Docker. In the arena, the attacker's kernel
tries the same calls under runc and gVisor, where the filter the kernel installed on itself
(stacked on Docker's copy under runc) answers.

Where it can be, a probe is chosen so the filter's answer differs from the kernel's own (not
for migrate_pages/move_pages under gVisor, which answers EPERM itself): ``socket(AF_ALG,
999, 0)`` is EINVAL from Linux and gVisor (the type is checked first; this host's Linux has no
AF_ALG at all, so a valid type would say EAFNOSUPPORT either way) but EAFNOSUPPORT from the
filter; ``io_setup(1, NULL)`` is EFAULT from the kernel, EPERM from the filter;
``get_mempolicy`` succeeds in both kernels, and is ENOSYS only because nothing lists it. The
host probes are harmless even if a filter let them through (the host tests may run as root).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.seccomp import DENIED_SYSCALLS, DOCKER_ALLOWED, seccomp_profile

pytestmark = pytest.mark.security

KERNEL_IMAGE_DIR = Path(__file__).resolve().parents[2] / "kernel-image"

PROBES = """import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
keep = []
def ptr(data):
    buf = ctypes.create_string_buffer(data)  # bytes (NUL added) or a size
    keep.append(buf)
    return ctypes.addressof(buf)
def call(nr, *args):
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return ret if ret >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
found = {
    "io_setup": call(206, 1, 0),
    "io_submit": call(209, 0, 0, 0),
    "mbind": call(237, 0, 0, 0, 0, 0, 0),
    "set_mempolicy": call(238, 0, 0, 0),
    "migrate_pages": call(256, 0, 0, 0, 0),
    "move_pages": call(279, 0, 0, 0, 0, 0, 0),
    "io_uring_setup": call(425, 1, 0),
    "unshare_user": call(272, 0x10000000),
    "clone_newuser": call(56, 0x10000000 | 0x10000, 0, 0, 0, 0),  # + CLONE_THREAD: EINVAL if it got through
    "clone_thread_only": call(56, 0x10000, 0, 0, 0, 0),
    "clone3": call(435, 0, 0),
    "af_alg": call(41, 38, 999, 0),
    "af_alg_high_bits": call(41, 0x100000026, 999, 0),
    "af_vsock": call(41, 40, 999, 0),
    "af_39": call(41, 39, 999, 0),
    "af_unix": call(41, 1, 999, 0),
    "get_mempolicy": call(239, 0, 0, 0, 0, 0),
    "process_madvise": call(440, -1, 0, 0, 0, 0),
    "nr_1000": call(1000),
    "personality_read_implies_exec": call(135, 0x0400000),
    "personality_query": call(135, 0xFFFFFFFF),
    "personality_linux": call(135, 0),
    "close_range": call(436, 1000, 1010, 0),
    "getrandom": call(318, ptr(16), 16, 0),
    "statx": call(332, -100, ptr(b"/"), 0, 0x7FF, ptr(256)),
    "getpid": call(39) == os.getpid(),
}
print(json.dumps(found))
"""

# What the filter answers, under every kernel (host Linux, runc, gVisor).
REFUSED = {
    "io_setup": "EPERM",  # the kernel: EFAULT
    "io_submit": "EPERM",
    "mbind": "EPERM",  # the kernel: 0
    "set_mempolicy": "EPERM",
    "migrate_pages": "EPERM",
    "move_pages": "EPERM",
    "io_uring_setup": "EPERM",
    "unshare_user": "EPERM",
    "clone_newuser": "EPERM",  # the kernel: EINVAL
    "clone3": "ENOSYS",  # the kernel: EINVAL
    "af_alg": "EAFNOSUPPORT",  # the kernel: EINVAL
    "af_alg_high_bits": "EAFNOSUPPORT",  # the kernel truncates the family to int: AF_ALG
    "af_vsock": "EAFNOSUPPORT",
    "get_mempolicy": "ENOSYS",  # unlisted; the kernel: 0
    "nr_1000": "ENOSYS",
    "personality_read_implies_exec": "ENOSYS",  # not a persona Docker allows; the kernel: accepted
}
# Let through: the kernel's own answer.
PASSED = {
    "clone_thread_only": "EINVAL",
    "af_39": "EINVAL",
    "af_unix": "EINVAL",
    "close_range": 0,
    "getrandom": 16,
    "statx": 0,
    "getpid": True,
}


def compiled_child(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` on the host in a fresh interpreter after it installs the compiled profile."""
    prelude = (
        f"import json, sys\nsys.path.insert(0, {str(KERNEL_IMAGE_DIR)!r})\n"
        "from seccomp_bpf import compile_profile, install\n"
        f"install(compile_profile(json.loads({json.dumps(seccomp_profile())!r})))\n"
    )
    return subprocess.run([sys.executable, "-I", "-c", prelude + code], capture_output=True, text=True, timeout=60)


def test_profile_is_dockers_allow_list_with_our_denials():
    profile = seccomp_profile()
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO" and profile["defaultErrnoRet"] == 38
    assert profile["architectures"] == ["SCMP_ARCH_X86_64"], "no 32-bit sub-architecture may be listed"
    allowed = {n for r in profile["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" and not r.get("args") for n in r["names"]}
    denied = {n for r in profile["syscalls"] if r["action"] != "SCMP_ACT_ALLOW" for n in r["names"]}
    assert allowed == set(DOCKER_ALLOWED) - denied
    assert not allowed & set(DENIED_SYSCALLS)
    assert {"io_setup", "io_submit", "mbind", "set_mempolicy", "migrate_pages", "move_pages"} <= denied
    assert {"ptrace", "bpf", "io_uring_setup", "unshare", "keyctl", "userfaultfd"} <= denied
    conditional = {r["names"][0] for r in profile["syscalls"] if r.get("args")}
    assert conditional == {"socket", "personality", "clone"}, "only Docker's conditional calls, and ours"
    first_allow = next(i for i, r in enumerate(profile["syscalls"]) if r["action"] == "SCMP_ACT_ALLOW")
    assert all(r["action"] == "SCMP_ACT_ALLOW" for r in profile["syscalls"][first_allow:]), "denials come first"


def test_compiled_filter_answers_in_a_host_process():
    done = compiled_child(PROBES)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert {k: found[k] for k in REFUSED} == REFUSED
    assert {k: found[k] for k in PASSED} == PASSED
    assert found["process_madvise"] == "ENOSYS", found  # unlisted; Linux would say EBADF
    assert found["personality_query"] == 0 and found["personality_linux"] == 0, found


@pytest.mark.parametrize(
    "abi, code",
    [
        ("x32", "import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 39)"),
        # mov eax, 20 (i386 getpid); int 0x80; ret -- run from an executable anonymous page
        (
            "i386",
            "import ctypes, mmap\n"
            "page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
            "page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))\n"
            "addr = ctypes.addressof(ctypes.c_char.from_buffer(page))\n"
            "ctypes.CFUNCTYPE(ctypes.c_int)(addr)()",
        ),
    ],
)
def test_other_syscall_abis_kill_the_process(abi, code):
    done = compiled_child(code + "\nprint('survived')")
    assert done.returncode == -signal.SIGSYS, (abi, done.returncode, done.stdout, done.stderr)


async def test_the_kernel_refuses_what_the_profile_denies(arena):
    found = await arena.probe(PROBES)
    assert {k: found[k] for k in REFUSED} == REFUSED, f"under {arena.runtime}: {found}"
    assert found["close_range"] == 0 and found["getrandom"] == 16 and found["statx"] == 0, found
    assert found["getpid"] is True and found["af_unix"] == "EINVAL" and found["af_39"] == "EINVAL", found
    # Allowed personas reach the kernel: Linux returns the current persona, gVisor (which
    # implements none) EINVAL; a refusal by the filter would be ENOSYS or EPERM.
    allowed = (0,) if arena.runtime == "runc" else ("EINVAL",)
    assert found["personality_query"] in allowed and found["personality_linux"] in allowed, found


async def test_ordinary_work_runs_under_the_allow_list(arena):
    found = await arena.probe(
        """import json, subprocess, sys, threading, io
import numpy as np, pandas as pd
import matplotlib
matplotlib.use("agg")
import matplotlib.pyplot as plt
out = {}
out["numpy"] = float(np.linalg.solve(np.array([[3.0, 1.0], [1.0, 2.0]]), np.array([9.0, 8.0])).sum())
out["pandas"] = int(pd.DataFrame({"a": range(1000)}).groupby(lambda i: i % 7)["a"].sum().sum())
box = []
workers = [threading.Thread(target=lambda i=i: box.append(sum(range(i * 1000)))) for i in range(8)]
[w.start() for w in workers]; [w.join() for w in workers]
out["threads"] = len(box)
out["subprocess"] = subprocess.run(["sh", "-c", "echo $((6 * 7))"], capture_output=True, text=True).stdout.strip()
pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
out["pip"] = pip.stdout.split()[:1] if pip.returncode == 0 else pip.stderr[-300:]
fig, ax = plt.subplots(); ax.plot([1, 2, 3], [3, 1, 2]); buf = io.BytesIO(); fig.savefig(buf, format="png")
out["png"] = buf.getvalue()[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
print(json.dumps(out))""",
        timeout=120,
    )
    assert found == {
        "numpy": 5.0,
        "pandas": sum(range(1000)),
        "threads": 8,
        "subprocess": "42",
        "pip": ["pip"],
        "png": True,
    }, f"under {arena.runtime}: {found}"


async def test_containers_carry_the_allow_list(arena):
    engine = default_engine()
    for session in (arena.attacker, arena.canary):
        [container] = engine.client.containers.list(filters={"label": f"sandkernel.session={session['id']}"})
        options = engine.client.api.inspect_container(container.id)["HostConfig"]["SecurityOpt"]
        [profile] = [json.loads(o[len("seccomp=") :]) for o in options if o.startswith("seccomp=")]
        assert profile["defaultAction"] == "SCMP_ACT_ERRNO" and profile.get("defaultErrnoRet") == 38
        assert profile == seccomp_profile(), "the container runs the profile kernels/sandbox/seccomp.py builds"
