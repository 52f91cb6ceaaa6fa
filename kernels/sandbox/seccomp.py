"""The seccomp profile every kernel container runs under: Docker's allow-list plus our denials.

The profile is an allow-list. It starts from Docker's default (moby's
``seccomp/default.json``, the rules that apply on x86_64 to a process holding no capability),
so the set of reachable syscalls is one that the container world reviews and keeps current.
Everything not listed is answered ENOSYS (``defaultErrnoRet``), so a newer glibc that tries a
syscall this list does not know yet falls back as it would on an older kernel; and a syscall a
future kernel adds is unreachable until someone lists it.

On top we deny, with an errno that says so, what an unprivileged process could still reach and
a Python kernel never needs: new namespaces and the mount API, ptrace and the other ways into
another process's memory, io_uring, bpf, perf, userfaultfd, keyrings, fanotify, Linux AIO
(``io_setup`` and friends: /proc/sys/fs/aio-max-nr is one host-wide budget that one tenant
could exhaust for every other), NUMA placement (mbind & co. reach host memory-policy code),
AF_ALG sockets (the kernel crypto API, a recurring source of kernel bugs) and AF_VSOCK sockets
(a path to the host), and the privileged-only calls (denied loudly rather than left to the
capability check). ``clone3`` answers ENOSYS: its flags live in memory, which seccomp cannot
inspect, and glibc then falls back to ``clone``, whose namespace flags we can deny.

Why our own profile at all: Debian 12's Docker 20.10 ships an older default (io_uring and
AF_VSOCK allowed), and the sandbox must not depend on which engine runs it. Only the native
architecture is listed, so the 32-bit ABIs (i386 via ``int 0x80``, x32) are refused outright.

Docker 20.10's daemon drops ``defaultErrnoRet`` (its OCI spec carries ``defaultAction`` only),
so its copy of this profile answers EPERM for unlisted calls. The kernel installs the same
profile on itself (``kernel-image/seccomp_bpf.py``: gVisor does not apply the OCI profile to
``docker exec`` processes); stacked, the kernel's errno wins, so code in the kernel sees ENOSYS
under both runtimes. This module is the one source: Docker gets it as JSON, the kernel reads
the same JSON from the runtime dir and compiles it to BPF.
"""

from __future__ import annotations

import functools
import json
import platform

EPERM = 1
ENOSYS = 38
EAFNOSUPPORT = 97
AF_ALG = 38
AF_VSOCK = 40

# Docker's default allow-list: github.com/moby/profiles seccomp/default.json at tag
# seccomp/v0.2.3 (836ae4d, 2026-05-06; the copy moby/moby master vendors, read 2026-08-23 at
# b985e23): the unconditional ALLOW rules that apply on x86_64 without capabilities, in
# upstream order (`python scripts/gen_syscall_table.py --moby-default default.json` prints it).
# Names x86_64 lacks are harmless (runc and our compiler skip them); names we deny below are
# taken out when the profile is built. Its conditional rules are DOCKER_CONDITIONAL_RULES.
DOCKER_ALLOWED = (
    "accept", "accept4", "access", "adjtimex", "alarm", "bind", "brk", "cachestat", "capget", "capset", "chdir",
    "chmod", "chown", "chown32", "clock_adjtime", "clock_adjtime64", "clock_getres", "clock_getres_time64",
    "clock_gettime", "clock_gettime64", "clock_nanosleep", "clock_nanosleep_time64", "close", "close_range",
    "connect", "copy_file_range", "creat", "dup", "dup2", "dup3", "epoll_create", "epoll_create1", "epoll_ctl",
    "epoll_ctl_old", "epoll_pwait", "epoll_pwait2", "epoll_wait", "epoll_wait_old", "eventfd", "eventfd2", "execve",
    "execveat", "exit", "exit_group", "faccessat", "faccessat2", "fadvise64", "fadvise64_64", "fallocate",
    "fanotify_mark", "fchdir", "fchmod", "fchmodat", "fchmodat2", "fchown", "fchown32", "fchownat", "fcntl",
    "fcntl64", "fdatasync", "fgetxattr", "flistxattr", "flock", "fork", "fremovexattr", "fsetxattr", "fstat",
    "fstat64", "fstatat64", "fstatfs", "fstatfs64", "fsync", "ftruncate", "ftruncate64", "futex", "futex_requeue",
    "futex_time64", "futex_wait", "futex_waitv", "futex_wake", "futimesat", "getcpu", "getcwd", "getdents",
    "getdents64", "getegid", "getegid32", "geteuid", "geteuid32", "getgid", "getgid32", "getgroups", "getgroups32",
    "getitimer", "getpeername", "getpgid", "getpgrp", "getpid", "getppid", "getpriority", "getrandom", "getresgid",
    "getresgid32", "getresuid", "getresuid32", "getrlimit", "get_robust_list", "getrusage", "getsid", "getsockname",
    "getsockopt", "get_thread_area", "gettid", "gettimeofday", "getuid", "getuid32", "getxattr", "getxattrat",
    "inotify_add_watch", "inotify_init", "inotify_init1", "inotify_rm_watch", "io_cancel", "ioctl", "io_destroy",
    "io_getevents", "io_pgetevents", "io_pgetevents_time64", "ioprio_get", "ioprio_set", "io_setup", "io_submit",
    "ipc", "kill", "landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self", "lchown", "lchown32",
    "lgetxattr", "link", "linkat", "listen", "listmount", "listxattr", "listxattrat", "llistxattr", "_llseek",
    "lremovexattr", "lseek", "lsetxattr", "lstat", "lstat64", "madvise", "map_shadow_stack", "membarrier",
    "memfd_create", "memfd_secret", "mincore", "mkdir", "mkdirat", "mknod", "mknodat", "mlock", "mlock2",
    "mlockall", "mmap", "mmap2", "mprotect", "mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive",
    "mq_timedreceive_time64", "mq_timedsend", "mq_timedsend_time64", "mq_unlink", "mremap", "mseal", "msgctl",
    "msgget", "msgrcv", "msgsnd", "msync", "munlock", "munlockall", "munmap", "name_to_handle_at", "nanosleep",
    "newfstatat", "_newselect", "open", "openat", "openat2", "pause", "pidfd_open", "pidfd_send_signal", "pipe",
    "pipe2", "pkey_alloc", "pkey_free", "pkey_mprotect", "poll", "ppoll", "ppoll_time64", "prctl", "pread64",
    "preadv", "preadv2", "prlimit64", "process_mrelease", "pselect6", "pselect6_time64", "pwrite64", "pwritev",
    "pwritev2", "read", "readahead", "readlink", "readlinkat", "readv", "recv", "recvfrom", "recvmmsg",
    "recvmmsg_time64", "recvmsg", "remap_file_pages", "removexattr", "removexattrat", "rename", "renameat",
    "renameat2", "restart_syscall", "riscv_hwprobe", "rmdir", "rseq", "rt_sigaction", "rt_sigpending",
    "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait",
    "rt_sigtimedwait_time64", "rt_tgsigqueueinfo", "sched_getaffinity", "sched_getattr", "sched_getparam",
    "sched_get_priority_max", "sched_get_priority_min", "sched_getscheduler", "sched_rr_get_interval",
    "sched_rr_get_interval_time64", "sched_setaffinity", "sched_setattr", "sched_setparam", "sched_setscheduler",
    "sched_yield", "seccomp", "select", "semctl", "semget", "semop", "semtimedop", "semtimedop_time64", "send",
    "sendfile", "sendfile64", "sendmmsg", "sendmsg", "sendto", "setfsgid", "setfsgid32", "setfsuid", "setfsuid32",
    "setgid", "setgid32", "setgroups", "setgroups32", "setitimer", "setpgid", "setpriority", "setregid",
    "setregid32", "setresgid", "setresgid32", "setresuid", "setresuid32", "setreuid", "setreuid32", "setrlimit",
    "set_robust_list", "setsid", "setsockopt", "set_thread_area", "set_tid_address", "setuid", "setuid32",
    "setxattr", "setxattrat", "shmat", "shmctl", "shmdt", "shmget", "shutdown", "sigaltstack", "signalfd",
    "signalfd4", "sigprocmask", "sigreturn", "socketcall", "socketpair", "splice", "stat", "stat64", "statfs",
    "statfs64", "statmount", "statx", "symlink", "symlinkat", "sync", "sync_file_range", "syncfs", "sysinfo", "tee",
    "tgkill", "time", "timer_create", "timer_delete", "timer_getoverrun", "timer_gettime", "timer_gettime64",
    "timer_settime", "timer_settime64", "timerfd_create", "timerfd_gettime", "timerfd_gettime64", "timerfd_settime",
    "timerfd_settime64", "times", "tkill", "truncate", "truncate64", "ugetrlimit", "umask", "uname", "unlink",
    "unlinkat", "uretprobe", "utime", "utimensat", "utimensat_time64", "utimes", "vfork", "vmsplice", "wait4",
    "waitid", "waitpid", "write", "writev", "process_vm_readv", "process_vm_writev", "ptrace", "arch_prctl",
    "modify_ldt",
)



def _allow_if(name: str, value: int, op: str) -> dict:
    return {"names": [name], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": value, "op": op}]}


# Docker's conditional rules for the same process (same source): socket families other than
# AF_ALG (38) and AF_VSOCK (40); the personalities glibc and setarch use (PER_LINUX, PER_LINUX32,
# ADDR_NO_RANDOMIZE, both, and 0xffffffff, the query); clone without namespace flags.
DOCKER_CONDITIONAL_RULES: tuple[dict, ...] = (
    _allow_if("socket", AF_ALG, "SCMP_CMP_LT"),
    _allow_if("socket", 39, "SCMP_CMP_EQ"),
    _allow_if("socket", AF_VSOCK, "SCMP_CMP_GT"),
    *(_allow_if("personality", value, "SCMP_CMP_EQ") for value in (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)),
    _allow_if("clone", 0x7E020000, "SCMP_CMP_MASKED_EQ"),  # (flags & every CLONE_NEW*) == 0
)

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
    # Linux AIO: every io_setup draws on one host-wide budget (fs.aio-max-nr) shared by all tenants
    "io_setup",
    "io_destroy",
    "io_submit",
    "io_cancel",
    "io_getevents",
    "io_pgetevents",
    # NUMA placement of memory: host memory-policy code no analysis needs
    "mbind",
    "set_mempolicy",
    "set_mempolicy_home_node",
    "migrate_pages",
    "move_pages",
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
    "sethostname",
    "setdomainname",
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
    """The profile as the dict Docker expects (``security_opt=["seccomp=" + json]``).

    Denials come first (the kernel's compiler tries them first; for libseccomp the order does
    not matter because no denial overlaps an allow rule of the same syscall)."""
    denials: list[dict] = [
        {"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
        # clone3 passes flags in memory, which seccomp cannot inspect: make glibc fall back to clone.
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        *(
            {
                "names": ["socket"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": EAFNOSUPPORT,
                "args": [{"index": 0, "value": family, "op": "SCMP_CMP_EQ"}],
            }
            for family in (AF_ALG, AF_VSOCK)
        ),
        *(
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": EPERM,
                "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
            }
            for flag in CLONE_NAMESPACE_FLAGS.values()
        ),
    ]
    denied = {name for rule in denials for name in rule["names"]}
    allowed = [name for name in DOCKER_ALLOWED if name not in denied]
    allows = [{"names": allowed, "action": "SCMP_ACT_ALLOW"}, *DOCKER_CONDITIONAL_RULES]
    arch = _NATIVE_ARCH.get(platform.machine(), "SCMP_ARCH_X86_64")
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": ENOSYS,
        "architectures": [arch],
        "syscalls": denials + allows,
    }


def seccomp_security_opt() -> str:
    """The ``--security-opt`` value carrying the profile inline."""
    return "seccomp=" + json.dumps(seccomp_profile(), separators=(",", ":"))
