"""The seccomp profile every kernel container runs under.

Why our own profile instead of the engine's default: Docker 20.10 (Debian 12's docker.io)
ships an old default that still allows ``io_uring_*`` and ``socket(AF_VSOCK)``; the profile
must not depend on which engine a user has. We use a deny list on top of the other layers
(non-root user, every capability dropped, no-new-privileges, read-only root): the denied
calls are the ones an unprivileged process can still reach that widen the kernel attack
surface (new namespaces, io_uring, bpf, perf, userfaultfd, keyrings, ptrace, vsock, the new
mount API) or that only privileged code needs. An allow list would be tighter but breaks
ordinary Python wheels whenever glibc adopts a new syscall; the trade is written down in
the README. Only the native architecture is listed, so the 32-bit syscall ABI (a classic way
around name-based filters) is refused outright.
"""

from __future__ import annotations

import functools
import json
import platform

EPERM = 1
ENOSYS = 38
EAFNOSUPPORT = 97
AF_VSOCK = 40

DENIED_SYSCALLS = (
    # namespaces and mounts: the usual first step of a container escape
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    # reaching other processes' memory
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    # large kernel attack surface reachable without privileges
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "fanotify_init",
    # privileged-only calls: deny early and loudly
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "syslog",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "iopl",
    "ioperm",
    "quotactl",
    "lookup_dcookie",
    "open_by_handle_at",
    "name_to_handle_at",
    "nfsservctl",
    "uselib",
    "vhangup",
)

# clone() flags that create namespaces; each gets a masked-equality deny rule.
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

_NATIVE_ARCH = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64", "arm64": "SCMP_ARCH_AARCH64"}


@functools.cache
def seccomp_profile() -> dict:
    """The profile as the dict Docker expects (``security_opt=["seccomp=" + json]``)."""
    rules: list[dict] = [
        {"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
        # clone3 passes flags in memory, which seccomp cannot inspect: make glibc fall back to clone.
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        {
            "names": ["socket"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": EAFNOSUPPORT,
            "args": [{"index": 0, "value": AF_VSOCK, "op": "SCMP_CMP_EQ"}],
        },
    ]
    for flag in CLONE_NAMESPACE_FLAGS.values():
        rules.append(
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": EPERM,
                "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
            }
        )
    arch = _NATIVE_ARCH.get(platform.machine(), "SCMP_ARCH_X86_64")
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": [arch], "syscalls": rules}


def seccomp_security_opt() -> str:
    """The ``--security-opt`` value carrying the profile inline."""
    return "seccomp=" + json.dumps(seccomp_profile(), separators=(",", ":"))
