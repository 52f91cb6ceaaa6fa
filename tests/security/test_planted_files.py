"""Files the tenant plants in its workspace never run with a process the host starts.

The workspace's ``.local/bin`` and ``site-packages`` are the tenant's (``%pip install`` puts
packages there, and they persist across restarts). A program or module planted there must not
stand in for what the host runs in the sandbox: the launcher and the kernel before its seccomp
filter is installed, the file API's helper, the restart's ``kill -KILL -1``, the interrupt's
signal, the start-failure log reader. Each planted file records that it ran; none may, the
restart must still end every leftover process, and ``%pip install`` must still persist.
"""

from __future__ import annotations

import io
import signal
import zipfile
from types import SimpleNamespace

import pytest

from sandkernel.kernels.sandbox.container import SandboxContainer
from sandkernel.kernels.sandbox.docker_engine import default_engine

pytestmark = [pytest.mark.security, pytest.mark.docker]

MARKERS = "/workspace/.pwned"
SITE = "/workspace/.local/lib/python3.11/site-packages"
# Programs the host used to find through PATH (docker exec resolves argv[0] with the container's PATH).
PROGRAMS = ["python", "python3", "sh", "dash", "cp", "mkdir", "rm", "dirname", "kill", "cat", "tail", "timeout", "env"]
# Modules start_kernel.py, the seccomp compiler and site import before the filter is installed.
MODULES = ["sitecustomize", "usercustomize", "json", "runpy", "platform", "struct", "seccomp_bpf", "ctypes"]
DAEMON_ARG = "4242.25"  # a sleep nothing else on the machine runs

# Each planted module records its import, then hands back the real module so the process works.
SHIM = """
import os as _os, sys as _sys, importlib as _importlib
_fd = _os.open({marker!r}, _os.O_WRONLY | _os.O_CREAT | _os.O_APPEND, 0o644)
_os.write(_fd, (str(_os.getpid()) + " " + repr(_sys.argv) + "\\n").encode()); _os.close(_fd)
_sys.modules.pop(__name__, None)
_saved = _sys.path[:]
_sys.path[:] = [p for p in _sys.path if not p.startswith("/workspace")]
try:
    _real = _importlib.import_module(__name__)
finally:
    _sys.path[:] = _saved
_sys.modules[__name__] = _real
"""

PLANT = f"""
import os, stat, subprocess
markers, site, bindir = {MARKERS!r}, {SITE!r}, "/workspace/.local/bin"
for d in (markers, site, bindir):
    os.makedirs(d, exist_ok=True)
real = {{"python": "/opt/kernel/bin/python", "python3": "/opt/kernel/bin/python"}}
for name in {PROGRAMS!r}:
    path = os.path.join(bindir, name)
    target = real.get(name, "/usr/bin/" + name if os.path.exists("/usr/bin/" + name) else "/bin/" + name)
    # A planted kill does nothing else: a restart that used it would leave the daemon alive.
    tail = "exit 0" if name == "kill" else f'exec {{target}} "$@"'
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\\necho \\"$$ $*\\" >> {{markers}}/bin-{{name}}\\n{{tail}}\\n")
    os.chmod(path, 0o755)
shim = {SHIM!r}
for name in {MODULES!r}:
    marker = os.path.join(markers, "module-" + name)
    if name == "ctypes":
        os.makedirs(os.path.join(site, name), exist_ok=True)
        path = os.path.join(site, name, "__init__.py")
    else:
        path = os.path.join(site, name + ".py")
    with open(path, "w") as f:
        f.write(shim.format(marker=marker))
subprocess.Popen(["/bin/sleep", {DAEMON_ARG!r}], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(sorted(os.listdir(bindir)), sorted(os.listdir(site)))
"""

SURVEY = f"""
import json, os
def processes():
    found = {{}}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{{pid}}/cmdline", "rb") as f:
                found[int(pid)] = f.read().replace(b"\\0", b" ").decode(errors="replace")[:120]
        except OSError:
            pass
    return found
markers = {{}}
for name in sorted(os.listdir({MARKERS!r}) if os.path.isdir({MARKERS!r}) else []):
    with open(os.path.join({MARKERS!r}, name)) as f:
        markers[name] = f.read()[-300:]
def daemons():
    return [pid for pid, cmdline in processes().items() if {DAEMON_ARG!r} in cmdline]
# every process too, for a failure's message: whether the kernel was restarted under the test, say
print(json.dumps({{"markers": markers, "daemons": daemons(), "processes": processes()}}))
"""


def attacker_container(arena) -> SandboxContainer:
    """The attacker session's container, driven through the same class the gateway uses."""
    engine = default_engine()
    [found] = engine.client.containers.list(filters={"label": f"sandkernel.session={arena.attacker['id']}"})
    return SandboxContainer(engine, found.id, SimpleNamespace(user=found.attrs["Config"]["User"]))


async def test_planted_programs_and_modules_never_run_for_the_host(arena):
    planted = await arena.attack(PLANT)
    assert planted["status"] == "ok", planted
    before = await arena.probe(SURVEY)
    assert before["daemons"] and not before["markers"], before
    sid = arena.attacker["id"]

    status, body = await arena.gateway.request("POST", f"/api/sessions/{sid}/restart")
    assert status == 200, body
    status, body = await arena.gateway.request("POST", f"/api/sessions/{sid}/interrupt")
    assert status in (200, 204), body
    status, body = await arena.gateway.request("PUT", f"/api/sessions/{sid}/files/up/a.txt", raw=b"uploaded")
    assert status == 201, body
    status, body = await arena.gateway.request("GET", f"/api/sessions/{sid}/files?path=up")
    assert status == 200 and [e["name"] for e in body] == ["a.txt"], body
    status, body = await arena.gateway.request("GET", f"/api/sessions/{sid}/files/up/a.txt")
    assert status == 200 and body == "uploaded", body
    container = attacker_container(arena)
    await container.kernel_log()
    await container.signal_kernel(signal.SIGWINCH)  # harmless to the kernel; runs the pid-file path

    after = await arena.probe(SURVEY)
    assert not after["markers"], f"planted files ran with host-started processes: {after['markers']}"
    assert not after["daemons"], "the restart left the user's daemon alive"
    # The kernel still sees the workspace's packages and programs (after its filter is in place).
    paths = await arena.probe(
        "import json, os, sys; print(json.dumps({'path': os.environ['PATH'], 'sys_path': sys.path}))"
    )
    assert paths["path"].startswith("/workspace/.local/bin:") and SITE in paths["sys_path"], paths
    cleanup = await arena.attack(f"import shutil; shutil.rmtree('/workspace/.local'); shutil.rmtree({MARKERS!r})")
    assert cleanup["status"] == "ok", cleanup


async def test_signal_kernel_does_not_trust_the_pid_file(arena):
    """The pid file is the sandbox's to write: a word list or a pid that means "every process"
    must not be obeyed (the harm is bounded by the sandbox uid, but the host must not be the tool)."""
    container = attacker_container(arena)
    started = await arena.attack(
        f"import subprocess; subprocess.Popen(['/bin/sleep', {DAEMON_ARG!r}], start_new_session=True)"
    )
    assert started["status"] == "ok", started
    original = (await arena.attack("print(open('/tmp/kernel.pid').read().strip())"))["text"].strip()
    assert original.isdigit(), original
    try:
        for hostile in ("-1", "-1 1", "0", "1", "$(id)", "12abc", " "):
            wrote = await arena.attack(f"open('/tmp/kernel.pid', 'w').write({hostile!r})")
            assert wrote["status"] == "ok", wrote
            await container.signal_kernel(signal.SIGTERM)
            alive = await arena.probe(SURVEY)
            assert alive["daemons"], f"pid file {hostile!r} made the host signal every sandbox process"
    finally:
        await arena.attack(f"open('/tmp/kernel.pid', 'w').write({original!r})")
    cleanup = await arena.attack(SURVEY + "\nfor pid in daemons(): os.kill(pid, 9)")
    assert cleanup["status"] == "ok", cleanup


def make_wheel(name: str = "sk_planted_pkg", version: str = "1.0") -> bytes:
    """A minimal pure-Python wheel, written by hand so the test needs no build backend."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "ANSWER = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: sandkernel-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for n, text in files.items():
            zf.writestr(n, text)
    return buf.getvalue()


async def test_pip_install_still_persists_across_restart(arena):
    sid = arena.attacker["id"]
    wheel = "sk_planted_pkg-1.0-py3-none-any.whl"
    status, body = await arena.gateway.request("PUT", f"/api/sessions/{sid}/files/wheels/{wheel}", raw=make_wheel())
    assert status == 201, body
    installed = await arena.attack(f"%pip install -q --no-index --no-deps /workspace/wheels/{wheel}", timeout=180)
    assert installed["status"] == "ok", installed.get("text")
    imported = await arena.attack("import sk_planted_pkg; print(sk_planted_pkg.ANSWER)")
    assert imported["text"] == "42\n", imported
    status, body = await arena.gateway.request("POST", f"/api/sessions/{sid}/restart")
    assert status == 200, body
    again = await arena.attack(
        "import sk_planted_pkg, subprocess, sys\nprint(sk_planted_pkg.ANSWER)\n"
        "print(subprocess.run([sys.executable, '-c', 'import sk_planted_pkg'],"
        " capture_output=True).returncode)"
    )
    assert again["text"] == "42\n0\n", again
    await arena.attack("import shutil; shutil.rmtree('/workspace/.local'); shutil.rmtree('/workspace/wheels')")
