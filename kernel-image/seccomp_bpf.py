"""Compile sandkernel's seccomp profile (Docker's JSON format) to classic BPF and install it.

Why the kernel filters itself: gVisor (runsc) does not apply the container's OCI seccomp
profile to processes started with ``docker exec``, and every kernel is one. So
``start_kernel.py`` installs the profile the host wrote (seccomp.json, the same dict Docker
gets from ``kernels/sandbox/seccomp.py``) on itself, after no_new_privs and before any user code
exists; children inherit it. Under runc it stacks on Docker's copy: the kernel applies the
strictest action, and between two ERRNO answers the newest filter's errno, ours. That also
makes ``defaultErrnoRet`` (ENOSYS for unlisted calls) true under Docker 20.10, whose daemon
drops that field and so answers EPERM from its own copy.

Pure Python and stdlib only: it runs in the image's isolated interpreter before anything else.

What it accepts (the subset of the format sandkernel's profile uses; anything else raises):

* ``defaultAction`` SCMP_ACT_ALLOW or SCMP_ACT_ERRNO (``defaultErrnoRet``, Docker's default 1);
* rules with action SCMP_ACT_ALLOW, SCMP_ACT_ERRNO (``errnoRet``) or SCMP_ACT_KILL_PROCESS,
  by name, with any number of argument conditions (all must hold) using SCMP_CMP_EQ, _NE,
  _LT, _LE, _GT, _GE and _MASKED_EQ (``value`` is the mask, ``valueTwo`` the result, as in
  Docker and libseccomp).

Semantics, where they differ from libseccomp's on purpose:

* ERRNO and KILL rules are tried before ALLOW rules; within each group, profile order. (With
  libseccomp the rules of one syscall must not overlap; sandkernel's do not, so this agrees.)
* Conditions compare the low 32 bits of the argument and refuse values above 0xFFFFFFFF. Each
  argument the profile tests is 32 bits wide in the kernel (socket's family, personality's
  persona, clone's flags: ``lower_32_bits(clone_flags)``); a full 64-bit comparison lets
  ``socket(0x1_00000026, ...)`` pass an "above 40" rule and reach AF_ALG (38) all the same.
* Names x86_64 lacks (32-bit-only calls, or calls newer than the header the table came from)
  are skipped, so those calls get the default action.
* Any other architecture token (i386 via ``int 0x80``) and the x32 ABI kill the process.

The program is a linear chain: one JEQ per listed syscall, each followed by that syscall's
block. Linux caches "always allowed" syscall numbers of a filter (5.11+), so unconditionally
allowed calls do not run it at all; see docs/security.md for the measured cost under gVisor.
"""

from __future__ import annotations

import ctypes
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
BPF_MAXINSNS = 4096

LD_W_ABS, JA, JEQ_K, JGT_K, JGE_K, AND_K, RET_K = 0x20, 0x05, 0x15, 0x25, 0x35, 0x54, 0x06
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
OFFSET_NR, OFFSET_ARCH, OFFSET_ARGS = 0, 4, 16  # struct seccomp_data; args are u64, little-endian
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2

Insn = tuple[int, int, int, int]  # (code, jt, jf, k), as struct sock_filter

# BEGIN GENERATED SYSCALL TABLE (scripts/gen_syscall_table.py, from unistd_64.h of linux-libc-dev 6.1.187-1)
X86_64_SYSCALLS: dict[str, int] = {
    "read": 0, "write": 1, "open": 2, "close": 3, "stat": 4, "fstat": 5, "lstat": 6, "poll": 7, "lseek": 8,
    "mmap": 9, "mprotect": 10, "munmap": 11, "brk": 12, "rt_sigaction": 13, "rt_sigprocmask": 14,
    "rt_sigreturn": 15, "ioctl": 16, "pread64": 17, "pwrite64": 18, "readv": 19, "writev": 20, "access": 21,
    "pipe": 22, "select": 23, "sched_yield": 24, "mremap": 25, "msync": 26, "mincore": 27, "madvise": 28,
    "shmget": 29, "shmat": 30, "shmctl": 31, "dup": 32, "dup2": 33, "pause": 34, "nanosleep": 35, "getitimer": 36,
    "alarm": 37, "setitimer": 38, "getpid": 39, "sendfile": 40, "socket": 41, "connect": 42, "accept": 43,
    "sendto": 44, "recvfrom": 45, "sendmsg": 46, "recvmsg": 47, "shutdown": 48, "bind": 49, "listen": 50,
    "getsockname": 51, "getpeername": 52, "socketpair": 53, "setsockopt": 54, "getsockopt": 55, "clone": 56,
    "fork": 57, "vfork": 58, "execve": 59, "exit": 60, "wait4": 61, "kill": 62, "uname": 63, "semget": 64,
    "semop": 65, "semctl": 66, "shmdt": 67, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "fcntl": 72,
    "flock": 73, "fsync": 74, "fdatasync": 75, "truncate": 76, "ftruncate": 77, "getdents": 78, "getcwd": 79,
    "chdir": 80, "fchdir": 81, "rename": 82, "mkdir": 83, "rmdir": 84, "creat": 85, "link": 86, "unlink": 87,
    "symlink": 88, "readlink": 89, "chmod": 90, "fchmod": 91, "chown": 92, "fchown": 93, "lchown": 94, "umask": 95,
    "gettimeofday": 96, "getrlimit": 97, "getrusage": 98, "sysinfo": 99, "times": 100, "ptrace": 101, "getuid": 102,
    "syslog": 103, "getgid": 104, "setuid": 105, "setgid": 106, "geteuid": 107, "getegid": 108, "setpgid": 109,
    "getppid": 110, "getpgrp": 111, "setsid": 112, "setreuid": 113, "setregid": 114, "getgroups": 115,
    "setgroups": 116, "setresuid": 117, "getresuid": 118, "setresgid": 119, "getresgid": 120, "getpgid": 121,
    "setfsuid": 122, "setfsgid": 123, "getsid": 124, "capget": 125, "capset": 126, "rt_sigpending": 127,
    "rt_sigtimedwait": 128, "rt_sigqueueinfo": 129, "rt_sigsuspend": 130, "sigaltstack": 131, "utime": 132,
    "mknod": 133, "uselib": 134, "personality": 135, "ustat": 136, "statfs": 137, "fstatfs": 138, "sysfs": 139,
    "getpriority": 140, "setpriority": 141, "sched_setparam": 142, "sched_getparam": 143, "sched_setscheduler": 144,
    "sched_getscheduler": 145, "sched_get_priority_max": 146, "sched_get_priority_min": 147,
    "sched_rr_get_interval": 148, "mlock": 149, "munlock": 150, "mlockall": 151, "munlockall": 152, "vhangup": 153,
    "modify_ldt": 154, "pivot_root": 155, "_sysctl": 156, "prctl": 157, "arch_prctl": 158, "adjtimex": 159,
    "setrlimit": 160, "chroot": 161, "sync": 162, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166,
    "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171, "iopl": 172,
    "ioperm": 173, "create_module": 174, "init_module": 175, "delete_module": 176, "get_kernel_syms": 177,
    "query_module": 178, "quotactl": 179, "nfsservctl": 180, "getpmsg": 181, "putpmsg": 182, "afs_syscall": 183,
    "tuxcall": 184, "security": 185, "gettid": 186, "readahead": 187, "setxattr": 188, "lsetxattr": 189,
    "fsetxattr": 190, "getxattr": 191, "lgetxattr": 192, "fgetxattr": 193, "listxattr": 194, "llistxattr": 195,
    "flistxattr": 196, "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199, "tkill": 200, "time": 201,
    "futex": 202, "sched_setaffinity": 203, "sched_getaffinity": 204, "set_thread_area": 205, "io_setup": 206,
    "io_destroy": 207, "io_getevents": 208, "io_submit": 209, "io_cancel": 210, "get_thread_area": 211,
    "lookup_dcookie": 212, "epoll_create": 213, "epoll_ctl_old": 214, "epoll_wait_old": 215,
    "remap_file_pages": 216, "getdents64": 217, "set_tid_address": 218, "restart_syscall": 219, "semtimedop": 220,
    "fadvise64": 221, "timer_create": 222, "timer_settime": 223, "timer_gettime": 224, "timer_getoverrun": 225,
    "timer_delete": 226, "clock_settime": 227, "clock_gettime": 228, "clock_getres": 229, "clock_nanosleep": 230,
    "exit_group": 231, "epoll_wait": 232, "epoll_ctl": 233, "tgkill": 234, "utimes": 235, "vserver": 236,
    "mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239, "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242,
    "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245, "kexec_load": 246, "waitid": 247,
    "add_key": 248, "request_key": 249, "keyctl": 250, "ioprio_set": 251, "ioprio_get": 252, "inotify_init": 253,
    "inotify_add_watch": 254, "inotify_rm_watch": 255, "migrate_pages": 256, "openat": 257, "mkdirat": 258,
    "mknodat": 259, "fchownat": 260, "futimesat": 261, "newfstatat": 262, "unlinkat": 263, "renameat": 264,
    "linkat": 265, "symlinkat": 266, "readlinkat": 267, "fchmodat": 268, "faccessat": 269, "pselect6": 270,
    "ppoll": 271, "unshare": 272, "set_robust_list": 273, "get_robust_list": 274, "splice": 275, "tee": 276,
    "sync_file_range": 277, "vmsplice": 278, "move_pages": 279, "utimensat": 280, "epoll_pwait": 281,
    "signalfd": 282, "timerfd_create": 283, "eventfd": 284, "fallocate": 285, "timerfd_settime": 286,
    "timerfd_gettime": 287, "accept4": 288, "signalfd4": 289, "eventfd2": 290, "epoll_create1": 291, "dup3": 292,
    "pipe2": 293, "inotify_init1": 294, "preadv": 295, "pwritev": 296, "rt_tgsigqueueinfo": 297,
    "perf_event_open": 298, "recvmmsg": 299, "fanotify_init": 300, "fanotify_mark": 301, "prlimit64": 302,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "clock_adjtime": 305, "syncfs": 306, "sendmmsg": 307,
    "setns": 308, "getcpu": 309, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "finit_module": 313, "sched_setattr": 314, "sched_getattr": 315, "renameat2": 316, "seccomp": 317,
    "getrandom": 318, "memfd_create": 319, "kexec_file_load": 320, "bpf": 321, "execveat": 322, "userfaultfd": 323,
    "membarrier": 324, "mlock2": 325, "copy_file_range": 326, "preadv2": 327, "pwritev2": 328, "pkey_mprotect": 329,
    "pkey_alloc": 330, "pkey_free": 331, "statx": 332, "io_pgetevents": 333, "rseq": 334, "pidfd_send_signal": 424,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "pidfd_open": 434, "clone3": 435,
    "close_range": 436, "openat2": 437, "pidfd_getfd": 438, "faccessat2": 439, "process_madvise": 440,
    "epoll_pwait2": 441, "mount_setattr": 442, "quotactl_fd": 443, "landlock_create_ruleset": 444,
    "landlock_add_rule": 445, "landlock_restrict_self": 446, "memfd_secret": 447, "process_mrelease": 448,
    "futex_waitv": 449, "set_mempolicy_home_node": 450,
}
# END GENERATED SYSCALL TABLE


def _action(action: str, errno: int | None) -> int:
    if action == "SCMP_ACT_ALLOW":
        return RET_ALLOW
    if action == "SCMP_ACT_ERRNO":
        return RET_ERRNO | ((1 if errno is None else errno) & 0xFFFF)
    if action in ("SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL"):
        return RET_KILL_PROCESS
    raise ValueError(f"unsupported seccomp action {action}")


def _condition(arg: dict, fail: int) -> list[Insn]:
    """Instructions that fall through when the condition holds and jump ``fail`` insns past
    their own end when it does not."""
    value, op = arg["value"], arg["op"]
    if not 0 <= value <= 0xFFFFFFFF or not 0 <= arg.get("valueTwo", 0) <= 0xFFFFFFFF:
        raise ValueError(f"seccomp argument values must fit in 32 bits: {arg}")
    load = (LD_W_ABS, 0, 0, OFFSET_ARGS + 8 * arg["index"])
    jumps = {  # op: (code, jump-if-true, jump-if-false); a jump of `fail` leaves the rule
        "SCMP_CMP_EQ": (JEQ_K, 0, fail),
        "SCMP_CMP_NE": (JEQ_K, fail, 0),
        "SCMP_CMP_GT": (JGT_K, 0, fail),
        "SCMP_CMP_GE": (JGE_K, 0, fail),
        "SCMP_CMP_LT": (JGE_K, fail, 0),
        "SCMP_CMP_LE": (JGT_K, fail, 0),
    }
    if op == "SCMP_CMP_MASKED_EQ":
        return [load, (AND_K, 0, 0, value), (JEQ_K, 0, fail, arg.get("valueTwo", 0))]
    if op not in jumps:
        raise ValueError(f"unsupported seccomp op {op}")
    code, jt, jf = jumps[op]
    return [load, (code, jt, jf, value)]


def _rule(args: list[dict], ret: int) -> list[Insn]:
    """A rule's block: its conditions, each jumping past the final RET when it fails."""
    block: list[Insn] = [(RET_K, 0, 0, ret)]
    for arg in reversed(args):
        block = _condition(arg, len(block)) + block
    return block


def compile_profile(profile: dict) -> list[Insn]:
    """Docker-format profile -> classic BPF program for x86_64 (list of (code, jt, jf, k))."""
    default = _action(profile["defaultAction"], profile.get("defaultErrnoRet"))
    rules = sorted(profile["syscalls"], key=lambda rule: rule["action"] == "SCMP_ACT_ALLOW")  # stable
    per_syscall: dict[int, list[Insn]] = {}
    finished: set[int] = set()  # syscalls whose block already ends in an unconditional return
    for rule in rules:
        ret = _action(rule["action"], rule.get("errnoRet"))
        for name in rule["names"]:
            nr = X86_64_SYSCALLS.get(name)
            if nr is None or nr in finished:
                continue
            per_syscall.setdefault(nr, []).extend(_rule(rule.get("args") or [], ret))
            if not rule.get("args"):
                finished.add(nr)
    prog: list[Insn] = [
        (LD_W_ABS, 0, 0, OFFSET_ARCH),
        (JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        (RET_K, 0, 0, RET_KILL_PROCESS),
        (LD_W_ABS, 0, 0, OFFSET_NR),
        (JGE_K, 0, 1, X32_SYSCALL_BIT),
        (RET_K, 0, 0, RET_KILL_PROCESS),
    ]
    for nr, block in per_syscall.items():
        if nr not in finished:
            block = [*block, (RET_K, 0, 0, default)]  # no rule matched: the default answers
        if len(block) > 255:
            raise ValueError(f"syscall {nr}: {len(block)} instructions exceed a BPF jump")
        prog.append((JEQ_K, 0, len(block), nr))
        prog += block
    prog.append((RET_K, 0, 0, default))
    if len(prog) > BPF_MAXINSNS:
        raise ValueError(f"{len(prog)} BPF instructions exceed the kernel's {BPF_MAXINSNS}")
    return prog


def install(prog: list[Insn]) -> None:
    """Set no_new_privs and install ``prog`` on the calling thread (and what it will start).

    Raises OSError if the kernel refuses; the caller must not run user code then."""
    libc = ctypes.CDLL(None, use_errno=True)
    raw = b"".join(struct.pack("HBBI", *insn) for insn in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buf))
    fprog_buf = ctypes.create_string_buffer(fprog, len(fprog))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_void_p(ctypes.addressof(fprog_buf)), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
