"""Kernel entry point inside the sandbox: install the seccomp filter, then run ipykernel.

Why a filter here as well as Docker's: gVisor (runsc) does not apply the container's OCI
seccomp profile to processes started with ``docker exec``, and every kernel is one. So the
kernel installs the same profile on itself (the host writes it as seccomp.json next to the
connection file), after setting no_new_privs, before any user code exists; children inherit
it. Under runc the filter stacks on Docker's identical one, which costs nothing.

The compiler (seccomp_bpf.py) says which part of Docker's profile format it handles and how
it differs from libseccomp. Syscalls from any other ABI (x32, i386) are refused outright.
Usage: start_kernel.py CONNECTION_FILE SECCOMP_JSON
"""

import json
import os
import platform
import runpy
import sys

import sandkernel_variables  # noqa: F401  bound in sys.modules before user code: no workspace file can shadow it
from iopub_budget import bound_iopub_bytes  # beside this file in /opt/sandkernel, as the next one
from seccomp_bpf import compile_profile, install


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
        # No history database: the transcript is the record. IPython's thread that saves it
        # printed its own failures (after a cell used up the process's fds) into cell output.
        "--HistoryManager.enabled=False",
    ]
    bound_iopub_queue()
    bound_iopub_bytes()
    if os.getppid() == 1:  # started by a savable sandbox's PID 1 (kernel_supervisor.py)
        take_new_key_on_signal()
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


def take_new_key_on_signal() -> None:
    """Take the key in the host's connection file when the supervisor asks (kernel_supervisor.py).

    A restored or forked copy of a saved kernel must answer only to its own session's new key:
    the old one opens nothing once this ran. It acknowledges with the SHA-256 of the key taken,
    and the supervisor attaches the host sockets only after that.
    """
    import hashlib
    import signal

    from ipykernel.kernelapp import IPKernelApp
    from kernel_supervisor import HOST_CONNECTION_FILE, KEY_ACK_FILE, REKEY_SIGNAL

    def rekey(signum, frame):  # type: ignore[no-untyped-def]
        with open(HOST_CONNECTION_FILE) as f:
            key = json.load(f)["key"]
        IPKernelApp.instance().session.key = key.encode()  # Session recomputes its HMAC on change
        with open(KEY_ACK_FILE, "w") as f:
            f.write(hashlib.sha256(key.encode()).hexdigest())

    signal.signal(REKEY_SIGNAL, rekey)


# Messages the kernel queues for each iopub subscriber that reads slower than the code writes.
# ZMQ's default (1000) lets a flood of 1 MiB chunks pile up a gigabyte in the kernel and end in
# an OOM kill; past this many, ZMQ drops output instead (the host keeps head and tail anyway).
# Not fewer than 64: ordinary widget code sends bursts (one tqdm.notebook bar is 13 comm_opens
# and 6 comm_msgs in a row), and at 16 the cell's own print after it was dropped in 13 of 100
# runs (tests/test_kernel_image.py); 64 x 1 MiB still fits the flood tests' 384 MiB sandbox.
# Larger messages are bounded in bytes as well (iopub_budget.py): 64 of them could be gigabytes.
IOPUB_SEND_QUEUE = 64


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
