"""Kernel entry point inside the sandbox: install the seccomp filter, then run ipykernel.

Why a filter here as well as Docker's: gVisor (runsc) does not apply the container's OCI
seccomp profile to processes started with ``docker exec``, and every kernel is one. So the
kernel installs the same profile on itself (the host writes it as seccomp.json next to the
connection file), after setting no_new_privs, before any user code exists; children inherit
it. Under runc the filter stacks on Docker's identical one, which costs nothing.

The compiler handles the subset of Docker's profile format that sandkernel's profile uses:
default ALLOW, ERRNO rules by name, optional SCMP_CMP_EQ / SCMP_CMP_MASKED_EQ on the low
32 bits of an argument. Syscalls from any other ABI (x32, i386) are refused outright.
Usage: start_kernel.py CONNECTION_FILE SECCOMP_JSON
"""

import ctypes
import json
import os
import platform
import runpy
import struct
import sys

# x86_64 syscall numbers for the names the profile uses (from asm/unistd_64.h).
X86_64_SYSCALLS = {
    "unshare": 272,
    "setns": 308,
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "chroot": 161,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "move_mount": 429,
    "open_tree": 428,
    "mount_setattr": 442,
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "pidfd_getfd": 438,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "bpf": 321,
    "perf_event_open": 298,
    "userfaultfd": 323,
    "keyctl": 250,
    "add_key": 248,
    "request_key": 249,
    "fanotify_init": 300,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "reboot": 169,
    "swapon": 167,
    "swapoff": 168,
    "acct": 163,
    "syslog": 103,
    "settimeofday": 164,
    "clock_settime": 227,
    "clock_adjtime": 305,
    "adjtimex": 159,
    "iopl": 172,
    "ioperm": 173,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "open_by_handle_at": 304,
    "name_to_handle_at": 303,
    "nfsservctl": 180,
    "uselib": 134,
    "vhangup": 153,
    "clone3": 435,
    "clone": 56,
    "socket": 41,
}
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

LD_W_ABS, JEQ_K, JGE_K, AND_K, RET_K = 0x20, 0x15, 0x35, 0x54, 0x06
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
OFFSET_NR, OFFSET_ARCH, OFFSET_ARGS = 0, 4, 16
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


def compile_profile(profile: dict) -> list[tuple[int, int, int, int]]:
    """Docker-format profile -> classic BPF program (list of (code, jt, jf, k))."""
    prog = [
        (LD_W_ABS, 0, 0, OFFSET_ARCH),
        (JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        (RET_K, 0, 0, RET_KILL_PROCESS),
        (LD_W_ABS, 0, 0, OFFSET_NR),
        (JGE_K, 0, 1, X32_SYSCALL_BIT),
        (RET_K, 0, 0, RET_KILL_PROCESS),
    ]
    for rule in profile["syscalls"]:
        if rule["action"] != "SCMP_ACT_ERRNO":
            continue
        ret = RET_ERRNO | (rule.get("errnoRet", 1) & 0xFFFF)
        for name in rule["names"]:
            nr = X86_64_SYSCALLS.get(name)
            if nr is None:
                continue
            block = []
            for arg in rule.get("args") or []:
                block.append((LD_W_ABS, 0, 0, OFFSET_ARGS + 8 * arg["index"]))
                if arg["op"] == "SCMP_CMP_MASKED_EQ":
                    block += [(AND_K, 0, 0, arg["value"]), (JEQ_K, 0, 1, arg["valueTwo"])]
                elif arg["op"] == "SCMP_CMP_EQ":
                    block.append((JEQ_K, 0, 1, arg["value"]))
                else:
                    raise ValueError(f"unsupported seccomp op {arg['op']}")
            if len(rule.get("args") or []) > 1:
                raise ValueError("only one argument condition per rule is supported")
            block.append((RET_K, 0, 0, ret))
            block.append((LD_W_ABS, 0, 0, OFFSET_NR))  # args clobbered A: reload the number
            prog.append((JEQ_K, 0, len(block), nr))
            prog += block
    prog.append((RET_K, 0, 0, RET_ALLOW))
    return prog


def install(prog: list[tuple[int, int, int, int]]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    raw = b"".join(struct.pack("HBBI", *insn) for insn in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buf))
    fprog_buf = ctypes.create_string_buffer(fprog, len(fprog))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_void_p(ctypes.addressof(fprog_buf)), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


def main() -> None:
    connection_file, seccomp_file = sys.argv[1], sys.argv[2]
    sys.dont_write_bytecode = True  # PYTHONDONTWRITEBYTECODE, which -E (see launch-kernel) ignores
    if platform.machine() == "x86_64":
        with open(seccomp_file) as f:
            install(compile_profile(json.load(f)))
    else:  # runc still applies Docker's profile; gVisor on other arches runs without this layer
        print(f"start_kernel: no in-kernel seccomp filter on {platform.machine()}", file=sys.stderr)
    os.umask(0)  # sockets connectable by an unprivileged host user; user code gets 022 (exec_lines)
    sys.argv = [
        "ipykernel_launcher",
        "-f",
        connection_file,
        "--IPKernelApp.exec_lines=import os as _sk_os; _sk_os.umask(0o022); del _sk_os",
    ]
    bound_iopub_queue()
    join_workspace_when_started()
    runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)


# The tenant's own programs and packages (`%pip install` writes here: PIP_PREFIX in the image).
WORKSPACE_BIN = "/workspace/.local/bin"
WORKSPACE_SITE = "/workspace/.local/lib/python3.11/site-packages"


def join_workspace_when_started() -> None:
    """Put the workspace's bin and site-packages on the kernel's paths once ipykernel is up.

    The image keeps them off PATH and PYTHONPATH so no host-started process can run a planted
    file. Here the filter is installed and ipykernel has imported its own stack and bound its
    sockets (init_code runs after both), so a planted module can shadow neither the kernel's
    start-up imports nor the standard library (the site goes after it, before the venv's
    site-packages, so an upgrade the tenant installs still wins). Children (``%pip``, ``!cmd``)
    get the same view through PATH and PYTHONPATH.
    """
    import pkgutil

    from ipykernel.kernelapp import IPKernelApp

    original = IPKernelApp.init_code

    def init_code(self):  # type: ignore[no-untyped-def]
        os.environ["PATH"] = f"{WORKSPACE_BIN}:{os.environ.get('PATH', '')}"
        os.environ["PYTHONPATH"] = WORKSPACE_SITE
        if WORKSPACE_SITE not in sys.path:
            first_site = next((i for i, p in enumerate(sys.path) if p == "" or p.endswith("-packages")), len(sys.path))
            sys.path.insert(first_site, WORKSPACE_SITE)
            # Its finder now, while the dir exists (the launcher made it): one made later, after
            # the tenant removed the dir, would be None for good and hide a reinstall.
            pkgutil.get_importer(WORKSPACE_SITE)
        original(self)

    IPKernelApp.init_code = init_code


# Messages the kernel queues for each iopub subscriber that reads slower than the code writes.
# ZMQ's default (1000) lets a flood of 1 MiB chunks pile up a gigabyte in the kernel and end in
# an OOM kill; past this many, ZMQ drops output instead (the host keeps head and tail anyway).
IOPUB_SEND_QUEUE = 16


def bound_iopub_queue() -> None:
    import zmq
    from ipykernel.kernelapp import IPKernelApp

    original = IPKernelApp.init_iopub

    def init_iopub(self, context):  # type: ignore[no-untyped-def]
        context.setsockopt(zmq.SNDHWM, IOPUB_SEND_QUEUE)  # a default for sockets made from here on
        try:
            original(self, context)
        finally:
            context.sockopts.pop(zmq.SNDHWM, None)  # the shell and control sockets keep ZMQ's

    IPKernelApp.init_iopub = init_iopub


if __name__ == "__main__":
    main()
