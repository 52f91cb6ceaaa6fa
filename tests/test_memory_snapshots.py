"""Memory snapshots through the session API (issue 33, step 4): under gVisor with
``--memory-snapshots on``, a pause keeps the kernel's memory and a resume carries on from it
(``restored_by: "checkpoint"``) with no cell re-run, across a gateway restart (which adopts a
live savable sandbox as any other), on its workspace disk kept whole (an open file still open);
a fork's children carry on from the parent's memory; an altered memory or disk image is refused
and another tenant gets 404; a pause whose memory cannot be saved still keeps the files.

Real parts: the gateway over HTTP, runsc's checkpoint, Docker's start from a checkpoint, the
snapshot store on disk. runsc only (runc has no memory checkpoint here: docs/snapshots.md).
"""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from sandkernel.kernels.sandbox.uncached_io import supports_uncached
from sandkernel.kernels.snapshots.disk import DISK
from sandkernel.kernels.snapshots.memory import MEMORY_PARTS
from sandkernel.kernels.snapshots.store import SnapshotStore

from .conftest import RUNSC, container_ids_of, require_runtime
from .gateway_fixtures import ALICE, BOB, start_gateway, stop_gateway
from .kernel_websocket import run_cell
from .test_execute import _make_wheel
from .test_snapshots import CHECK, EXPECTED, STATE, _execute, _text

# A seeded generator mid-stream, and what its next draw must be (read from a copy, so the
# original is not advanced).
GENERATOR = "import copy\nrng = np.random.default_rng(11); rng.random(3)\nprint(repr(copy.deepcopy(rng).random()))"
NEXT_DRAW = "print(repr(rng.random()))"
# A file the kernel holds open across the pause: with the disk kept whole, the same file.
OPEN_FILE = "log = open('/workspace/log.txt', 'a'); log.write('before\\n'); log.flush()"
OPEN_FILE_AFTER = "log.write('after\\n'); log.close(); print(open('/workspace/log.txt').read(), end='')"
ZMQ_HANDSHAKE_SECONDS = 30  # libzmq's ZMQ_HANDSHAKE_IVL default: how long a connection with no greeting is kept


@pytest.mark.parametrize("runtime", [RUNSC])
async def test_a_paused_gvisor_session_resumes_from_its_memory_after_a_gateway_restart(tmp_path, runtime):
    require_runtime(runtime)
    state_dir = tmp_path / "state"
    options = {"default_runtime": runtime, "memory_snapshots": "on", "state_dir": state_dir}
    gw = await start_gateway(tmp_path, on_exit="keep", **options)
    stopped = False
    try:
        _, session = await gw.request("POST", "/api/sessions", {"limits": {"memory_mb": 2048}})
        sid = session["id"]
        wheel = _make_wheel(tmp_path)
        assert (await gw.request("PUT", f"/api/sessions/{sid}/files/{wheel.name}", raw=wheel.read_bytes()))[0] == 201
        install = await _execute(gw, sid, f"%pip install -q --no-index /workspace/{wheel.name}")
        assert install["status"] == "ok", install
        assert _text(await _execute(gw, sid, STATE)) == "built\n"
        expected_draw = _text(await _execute(gw, sid, GENERATOR))
        assert (await _execute(gw, sid, OPEN_FILE))["status"] == "ok"
        before = container_ids_of(sid)
        _, live = await gw.request("POST", "/api/sessions", {})  # stays live: adopted after the restart
        await _execute(gw, live["id"], "y = 7")

        code, paused = await gw.request("POST", f"/api/sessions/{sid}/pause")
        assert code == 200, paused
        assert container_ids_of(sid) == []
        store = SnapshotStore(state_dir / "snapshots")
        [manifest] = store.list(sid)
        # The memory and the workspace disk, whole: no files archive went through the sandbox.
        assert set(manifest.parts) == {*MEMORY_PARTS, DISK, "transcript"}, manifest.parts
        assert all(store.part_path(manifest, name).stat().st_mode & 0o777 == 0o600 for name in manifest.parts)
        disk = store.part_path(manifest, DISK).stat()
        assert paused["snapshot"]["bytes"] < manifest.bytes and disk.st_blocks * 512 < disk.st_size  # holes kept
        assert not list((state_dir / "workspaces").glob(f"{sid}*")), "the disk stayed in the workspaces dir"

        await stop_gateway(gw)
        stopped = True
        gw = await start_gateway(tmp_path, on_exit="delete", **options)
        stopped = False
        for action in ("resume", "fork"):  # another tenant: not found, and nothing is started
            code, reply = await gw.request("POST", f"/api/sessions/{sid}/{action}", {"count": 1}, token=BOB)
            assert code == 404, (action, reply)
        assert container_ids_of(sid) == []

        code, resumed = await gw.request("POST", f"/api/sessions/{sid}/resume")
        assert code == 200, resumed
        assert resumed["restored_by"] == "checkpoint" and resumed["cells"] == [], resumed
        assert resumed["files"] == "snapshot" and resumed["unpacked"] == 0  # the disk came back, nothing unpacked
        assert container_ids_of(sid) and container_ids_of(sid) != before
        draw = await _execute(gw, sid, NEXT_DRAW)
        assert _text(draw) == expected_draw, "the generator did not carry on where it was"
        assert draw["execution_count"] == 5, "a cell ran again: the kernel's count moved past the recorded 4"
        assert _text(await _execute(gw, sid, CHECK)) == EXPECTED
        assert _text(await _execute(gw, sid, OPEN_FILE_AFTER)) == "before\nafter\n"  # the same open file
        assert _text(await _execute(gw, live["id"], "print(y)")) == "7\n"  # a live savable sandbox, adopted
        code, notebook = await gw.request("GET", f"/api/sessions/{sid}/notebook")
        code_cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
        assert len(code_cells) == 7  # the four before the pause and the three after: none re-run
        assert any(
            "memory checkpoint" in "".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown"
        )
    finally:
        if not stopped:
            await stop_gateway(gw)


@pytest.mark.parametrize("runtime", [RUNSC])
async def test_a_store_that_refuses_o_direct_still_pauses_and_resumes_from_memory(tmp_path, runtime):
    """The memory image and the disk's copy are written and read past the page cache where the
    store's filesystem allows O_DIRECT (kernels/sandbox/uncached_io.py), through it elsewhere:
    with the snapshot store on a ramfs, which refuses O_DIRECT, a kernel pauses and resumes from
    its memory all the same (runsc without --direct, the hashes through the page cache)."""
    require_runtime(runtime)
    ramfs = tmp_path / "ramfs"
    ramfs.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "-o", "mode=0700", "ramfs", str(ramfs)], check=True)
    try:
        assert not supports_uncached(ramfs)
        store_dir = ramfs / "snapshots"
        gw = await start_gateway(tmp_path, default_runtime=runtime, memory_snapshots="on", snapshot_dir=store_dir)
        try:
            _, session = await gw.request("POST", "/api/sessions", {"limits": {"workspace_mb": 64}})
            sid = session["id"]
            expected_draw = _text(await _execute(gw, sid, "import numpy as np\n" + GENERATOR))
            await _execute(gw, sid, "open('/workspace/notes.txt', 'w').write('kept')")
            code, paused = await gw.request("POST", f"/api/sessions/{sid}/pause")
            assert code == 200, paused
            [manifest] = SnapshotStore(store_dir).list(sid)
            assert set(MEMORY_PARTS) <= set(manifest.parts), manifest.parts
            code, resumed = await gw.request("POST", f"/api/sessions/{sid}/resume")
            assert code == 200 and resumed["restored_by"] == "checkpoint", resumed
            assert _text(await _execute(gw, sid, NEXT_DRAW)) == expected_draw
            assert _text(await _execute(gw, sid, "print(open('/workspace/notes.txt').read())")) == "kept\n"
        finally:
            await stop_gateway(gw)
    finally:
        subprocess.run(["umount", str(ramfs)], check=True)


@pytest.mark.parametrize("runtime", [RUNSC])
@pytest.mark.parametrize(("part", "named"), [("memory_pages", "memory part"), (DISK, "workspace disk")])
async def test_an_altered_memory_image_or_disk_is_refused_and_the_session_stays_paused(tmp_path, runtime, part, named):
    require_runtime(runtime)
    state_dir = tmp_path / "state"
    gw = await start_gateway(tmp_path, default_runtime=runtime, memory_snapshots="on", state_dir=state_dir)
    try:
        _, session = await gw.request("POST", "/api/sessions", {})
        sid = session["id"]
        await _execute(gw, sid, "secret = 'kept'; open('/workspace/notes.txt', 'w').write('x' * 100_000)")
        assert (await gw.request("POST", f"/api/sessions/{sid}/pause"))[0] == 200
        store = SnapshotStore(state_dir / "snapshots")
        [manifest] = store.list(sid)
        altered = store.part_path(manifest, part)
        with open(altered, "r+b") as f:  # one byte flipped where there is data, the size kept
            data_at = os.lseek(f.fileno(), altered.stat().st_size // 2, os.SEEK_DATA) if part == DISK else None
            f.seek(data_at if data_at is not None else altered.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))

        code, reply = await gw.request("POST", f"/api/sessions/{sid}/resume")
        assert code == 409 and reply["error"] == "snapshot_rejected", reply
        assert named in reply["message"]
        assert container_ids_of(sid) == []  # nothing was started from the altered image
        assert not list((state_dir / "workspaces").glob(f"{sid}*")), "a copy of the altered disk was left"
        code, model = await gw.request("GET", f"/api/sessions/{sid}")
        assert model["state"] == "paused"
        assert not [p for p in (state_dir / "snapshots").iterdir() if p.name.startswith("restore-")]
        _, other = await gw.request("POST", "/api/sessions", {})  # the tenant's other work goes on
        assert _text(await _execute(gw, other["id"], "print(1 + 1)")) == "2\n"
    finally:
        await stop_gateway(gw)


@pytest.mark.parametrize("runtime", [RUNSC])
async def test_forks_carry_on_from_the_parents_memory_each_with_its_own_key(tmp_path, runtime):
    """Fork into 3: each child continues the parent's generator independently from the same
    point, the parent goes on untouched, no cell re-runs, and every child has a key of its own
    that the parent's does not open."""
    require_runtime(runtime)
    gw = await start_gateway(tmp_path, default_runtime=runtime, memory_snapshots="on", max_sessions=6)
    try:
        _, session = await gw.request("POST", "/api/sessions", {})
        sid = session["id"]
        await _execute(gw, sid, "import numpy as np; open('/workspace/shared.txt', 'w').write('parent')")
        expected_draw = _text(await _execute(gw, sid, GENERATOR))
        ws = await websocket_connect(  # JupyterLab on the parent: ZMQ sockets of its own
            HTTPRequest(
                gw.url.replace("http", "ws") + f"/api/kernels/{session['kernel']['id']}/channels",
                headers={"Authorization": f"token {ALICE}"},
            )
        )
        code, forked = await gw.request("POST", f"/api/sessions/{sid}/fork", {"count": 3})
        assert code == 201, forked
        # Its sockets reconnected while the parent was saved, and answer now: before the supervisor
        # removed its socket files at the detach, they sat out ZMQ's handshake interval first.
        async with asyncio.timeout(ZMQ_HANDSHAKE_SECONDS / 2):
            reply, text = await run_cell(ws, "print(6 * 7)")
        assert (reply["status"], text) == ("ok", "42\n")
        ws.close()
        forks = [f["session"]["id"] for f in forked["forks"]]
        assert [f["restored_by"] for f in forked["forks"]] == ["checkpoint"] * 3, forked
        assert all(f["cells"] == [] for f in forked["forks"])
        assert all(f["unpacked"] == 0 for f in forked["forks"]), "a child's files went through tar"  # a disk copy
        for fork in forks:
            reply = await _execute(gw, fork, NEXT_DRAW)
            assert _text(reply) == expected_draw and reply["execution_count"] == 3, reply
        assert _text(await _execute(gw, sid, NEXT_DRAW)) == expected_draw  # the parent: its own next draw
        # Each child has its own copy of the parent's disk: a child's write reaches no one else.
        write = "open('/workspace/shared.txt', 'w').write('first child'); print(open('/workspace/shared.txt').read())"
        assert _text(await _execute(gw, forks[0], write)) == "first child\n"
        for other in (sid, *forks[1:]):
            assert _text(await _execute(gw, other, "print(open('/workspace/shared.txt').read())")) == "parent\n"
        keys = {key_of(gw, s) for s in [sid, *forks]}
        assert len(keys) == 4, "a fork shares a kernel key"
    finally:
        await stop_gateway(gw)


def key_of(gw, session_id: str) -> bytes:
    """The kernel key the gateway holds for a live session (behind the API, as only a test may)."""
    return gw.server.registry.get("alice", session_id).session.kernel_manager.session.key


@pytest.mark.parametrize("runtime", [RUNSC])
async def test_rewind_and_fork_at_a_cell_return_to_its_memory(tmp_path, runtime):
    """With --checkpoint-every-cell, a savable session's cell checkpoints keep its memory too: a
    rewind (and a fork at a cell) gives back a random token exactly as the cell left it, which a
    replay would draw anew, with no cell re-run and the execution count going on from there."""
    require_runtime(runtime)
    gw = await start_gateway(tmp_path, default_runtime=runtime, memory_snapshots="on", checkpoint_every_cell=True)
    try:
        _, session = await gw.request("POST", "/api/sessions", {})
        sid = session["id"]
        token = _text(await _execute(gw, sid, "import secrets; token = secrets.token_hex(8); print(token)")).strip()
        await _execute(gw, sid, "later = 2")  # cell 2 (its admission waited for cell 1's checkpoint)
        await _execute(gw, sid, "token = 'changed'")  # cell 3

        code, forked = await gw.request("POST", f"/api/sessions/{sid}/fork", {"count": 1, "cell": 2})
        assert code == 201, forked
        (fork,) = forked["forks"]
        assert (fork["restored_by"], fork["cells"], fork["files"]) == ("checkpoint", [], "checkpoint"), fork
        reply = await _execute(gw, fork["session"]["id"], "print(token, later)")
        assert (_text(reply), reply["execution_count"]) == (f"{token} 2\n", 3), reply

        code, rewound = await gw.request("POST", f"/api/sessions/{sid}/rewind", {"cell": 1})
        assert code == 200, rewound
        assert (rewound["restored_by"], rewound["cells"], rewound["files"]) == ("checkpoint", [], "checkpoint")
        reply = await _execute(gw, sid, "print(token, 'later' in dir())")
        assert (_text(reply), reply["execution_count"]) == (f"{token} False\n", 2), reply
    finally:
        await stop_gateway(gw)


@pytest.mark.parametrize("runtime", [RUNSC])
@pytest.mark.parametrize(
    ("cause", "options"),
    [
        ("no room in the quota", {"snapshot_quota_mb": 300}),
        # A unix socket bound in /workspace is a host socket (a gofer mount): gVisor cannot save it.
        ("a host socket", {}),
    ],
)
async def test_a_pause_whose_memory_cannot_be_saved_keeps_the_files_and_resumes_by_replay(
    tmp_path, runtime, cause, options
):
    """The memory image cannot be made (the tenant's quota has room for its files, not for its
    memory; the kernel holds a socket gVisor cannot save, and its sentry panics): the pause still
    succeeds, keeping the files, and the resume re-runs the cells over them (restored_by replay).
    Before the disk was kept whole, the host socket case archived the files first; keeping the
    disk after the save, a first version archived them after a failed save, from a sandbox that
    was dying, and the pause failed."""
    require_runtime(runtime)
    gw = await start_gateway(tmp_path, default_runtime=runtime, memory_snapshots="on", **options)
    try:
        _, session = await gw.request("POST", "/api/sessions", {"limits": {"memory_mb": 512}})
        sid = session["id"]
        cell = "open('/workspace/kept.txt', 'w').write('on the disk'); total = 40 + 2"
        if cause == "a host socket":
            cell += "\nimport socket; held = socket.socket(socket.AF_UNIX); held.bind('/workspace/held.sock')"
        assert (await _execute(gw, sid, cell))["status"] == "ok"
        code, paused = await gw.request("POST", f"/api/sessions/{sid}/pause")
        assert code == 200, paused
        assert container_ids_of(sid) == []
        code, resumed = await gw.request("POST", f"/api/sessions/{sid}/resume")
        assert code == 200, resumed
        assert (resumed["restored_by"], resumed["files"]) == ("replay", "snapshot"), resumed
        if cause == "a host socket":  # the failed save ended the sandbox: its disk was kept whole
            assert resumed["unpacked"] == 0 and any("/tmp was not kept" in n for n in resumed["notes"]), resumed
        else:  # nothing was tried: the files were archived through the running sandbox, /tmp too
            assert resumed["unpacked"] >= 1, resumed
        assert _text(await _execute(gw, sid, "print(open('/workspace/kept.txt').read(), total)")) == "on the disk 42\n"
    finally:
        await stop_gateway(gw)
