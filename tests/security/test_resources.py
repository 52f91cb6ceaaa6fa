"""Resource abuse: each attack ends with a clear status within its limits, the gateway's memory
stays bounded, and the canary (another tenant) keeps executing; its latency during the attack
is recorded next to its idle latency (never asserted: timing is for docs/security.md)."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from sandkernel.kernels.model.profiles import Profile

from ..gateway_fixtures import PeakRss
from .conftest import ATTACKER_LIMITS, record_slowdown

pytestmark = [pytest.mark.security, pytest.mark.docker, pytest.mark.slow]


async def under_attack(arena, name: str, code: str, timeout: float) -> dict:
    """Run the attack while the canary keeps executing; returns the attack's reply."""
    idle = statistics.median([await arena.canary_execute() for _ in range(3)])
    attack = asyncio.create_task(arena.attack(code, timeout))
    during = []
    while not attack.done():
        during.append(await arena.canary_execute())
        await asyncio.sleep(0.2)
    reply = await attack
    record_slowdown(arena.runtime, name, idle, during)
    return reply


async def recovers(arena) -> None:
    after = await arena.attack("print('recovered')")
    assert after["status"] == "ok" and after["text"] == "recovered\n", after


async def test_fork_bomb(arena):
    reply = await under_attack(
        arena, "fork_bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", 10
    )
    assert reply["status"] in ("timeout", "kernel_died", "oom"), reply["status"]
    await recovers(arena)


async def test_thread_bomb(arena):
    reply = await under_attack(
        arena,
        "thread_bomb",
        """import threading, time
threads = []
try:
    while True:
        t = threading.Thread(target=time.sleep, args=(30,), daemon=True); t.start(); threads.append(t)
except RuntimeError as e:
    print('stopped at', len(threads), e)""",
        60,
    )
    assert reply["status"] in ("ok", "oom", "kernel_died", "timeout"), reply
    if reply["status"] == "ok":
        assert "can't start new thread" in reply["text"]
        assert int(reply["text"].split()[2]) < ATTACKER_LIMITS["pids"] * 4
    await arena.attack("import os; os._exit(0)")  # drop the sleeping threads with the kernel
    await recovers(arena)


async def test_memory_bomb(arena):
    reply = await under_attack(arena, "memory_bomb", "b = bytearray(3 * 1024**3)", 60)
    assert reply["status"] == "oom" and "ran out of memory" in reply["state_lost"], reply
    await recovers(arena)


@pytest.mark.parametrize(("where", "cap"), [("/tmp", "tmp_mb"), ("/workspace", "workspace_mb")])
async def test_filling_a_disk_stops_at_its_cap(arena, where, cap):
    reply = await under_attack(
        arena,
        f"fill_{where.strip('/')}",
        f"""import os
written = 0
try:
    for i in range(100000):
        with open(f'{where}/fill-{{i}}', 'wb') as f:
            for _ in range(16):
                f.write(b'x' * 2**20); written += 2**20
except OSError as e:
    print(e.strerror, written // 2**20)
finally:
    for name in os.listdir('{where}'):
        if name.startswith('fill-'):
            os.unlink(os.path.join('{where}', name))""",
        120,
    )
    assert reply["status"] == "ok" and reply["text"].startswith("No space left on device"), reply
    assert int(reply["text"].split()[-1]) <= ATTACKER_LIMITS[cap]


async def test_file_size_and_open_files_are_capped(arena):
    found = await arena.probe(
        """import json, os
out = {}
try:
    with open('/workspace/big', 'wb') as f:
        for _ in range(64):
            f.write(b'x' * 2**20)
except OSError as e:
    out['fsize'] = [e.strerror, os.path.getsize('/workspace/big') // 2**20]
os.unlink('/workspace/big')
files = []
try:
    while True:
        files.append(open('/dev/null'))
except OSError as e:
    out['nofile'] = [e.strerror, len(files)]
for f in files:
    f.close()
print(json.dumps(out))"""
    )
    assert found["fsize"] == ["File too large", ATTACKER_LIMITS["fsize_mb"]]
    assert found["nofile"][0] == "Too many open files" and found["nofile"][1] < ATTACKER_LIMITS["nofile"]


async def test_inotify_exhaustion_stays_in_the_sandbox(arena):
    """inotify instances are counted per host uid: each sandbox has its own, so exhausting them
    leaves the canary (another uid) able to create one."""
    found = await arena.probe(
        """import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while True:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    fds.append(fd)
err = errno.errorcode.get(ctypes.get_errno())
print(json.dumps([len(fds), err]))"""
    )
    assert found[1] in ("EMFILE", "ENFILE"), found
    canary = await arena.canary_run(
        "import ctypes; libc = ctypes.CDLL(None); fd = libc.inotify_init1(0); print(fd >= 0); __import__('os').close(fd)"
    )
    assert canary["text"] == "True\n", canary
    await arena.attack("import os; os._exit(0)")  # release the attacker's instances with its kernel
    await recovers(arena)


@pytest.mark.parametrize(
    ("name", "code", "ended_by"),
    [
        ("python_loop", "while True:\n    pass", {"interrupt"}),
        ("sleep_forever", "import time\ntime.sleep(10**6)", {"interrupt"}),
        ("c_level_loop", "import re\nre.match(r'(a+)+$', 'a' * 64 + 'b')", {"restart", "kill"}),
    ],
)
async def test_runaway_code_ends_at_its_timeout(arena, name, code, ended_by):
    reply = await under_attack(arena, name, code, 3)
    assert reply["status"] == "timeout" and reply["ended_by"] in ended_by, reply
    assert reply["duration"] < ladder_worst_case(3), reply
    await recovers(arena)


def ladder_worst_case(timeout: float) -> float:
    """The ladder's own bound: the timeout, the interrupt's grace, a restart allowed
    ``start_timeout + grace``, then a container replacement allowed ``start_timeout`` (a loaded
    gVisor host can take the slow rungs; the test checks the ladder ends the code, not its speed)."""
    grace, start = ATTACKER_LIMITS["interrupt_grace"], Profile().start_timeout
    return timeout + grace + (start + grace) + start


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("huge_line", "print('x' * 50_000_000)"),  # one 50 MB line; 100 MB needs more than 384 MiB to print
        (
            "flood_1gib",
            "import sys\nchunk = 'x' * 2**20 + '\\n'\nfor _ in range(1024):\n    sys.stdout.write(chunk); sys.stdout.flush()",
        ),
        # 5,000 messages of 20 bytes, 100 KB of text: over the 64 KiB reply budget. (Under gVisor's
        # ptrace platform each flushed line costs the kernel about 5 ms, whatever its length: 20,000
        # shorter lines showed the same and took 72 s, 50,000 over 4 minutes.)
        ("many_small_outputs", "for i in range(5_000):\n    print(f'{i:>19}', flush=True)"),
    ],
)
async def test_output_floods_are_budgeted(arena, name, code):
    async with PeakRss() as rss:
        reply = await under_attack(arena, name, code, 300)
    assert reply["status"] == "ok", reply["status"]
    text_bytes = len(reply["text"].encode())
    assert text_bytes < 70 * 1024, f"{text_bytes} bytes of text in the reply"
    if not reply["truncation"]["truncated"]:
        # Only a flood of small messages can arrive whole yet under the budget: when the host reads
        # slower than the kernel prints (a loaded machine), the kernel's iopub queue (64 messages,
        # kernel-image/start_kernel.py) drops what does not fit, and fewer than 64 KiB arrive.
        assert name == "many_small_outputs" and text_bytes <= 64 * 1024, reply["truncation"]
    assert rss.growth < 400, f"gateway grew {rss.growth:.0f} MiB"


async def test_giant_image_is_summarised(arena):
    reply = await under_attack(
        arena,
        "giant_image",
        "import os\nfrom IPython.display import Image, display\n"
        "display(Image(data=b'\\x89PNG\\r\\n\\x1a\\n' + os.urandom(30 * 2**20), format='png'))",
        120,
    )
    assert reply["status"] == "ok" and reply["truncation"]["images_omitted"] == 1, reply["truncation"]
    assert "omitted" in reply["text"]


async def test_zip_bomb_stops_at_the_workspace_limits(arena):
    reply = await under_attack(
        arena,
        "zip_bomb",
        """import os, shutil, zipfile
with zipfile.ZipFile('bomb.zip', 'w', zipfile.ZIP_DEFLATED) as z:
    with z.open('zeros', 'w', force_zip64=True) as f:
        for _ in range(600):
            f.write(bytes(2**20))
print('bomb', os.path.getsize('bomb.zip') // 1024, 'KiB')
try:
    zipfile.ZipFile('bomb.zip').extractall('out')
except OSError as e:
    print('stopped:', e.strerror, os.path.getsize('out/zeros') // 2**20)
finally:
    shutil.rmtree('out', ignore_errors=True); os.unlink('bomb.zip')""",
        120,
    )
    assert reply["status"] == "ok", reply
    stopped = reply["text"].splitlines()[-1]
    assert stopped.startswith(("stopped: File too large", "stopped: No space left on device")), reply["text"]
    assert int(stopped.split()[-1]) <= ATTACKER_LIMITS["fsize_mb"]
