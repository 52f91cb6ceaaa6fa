"""Pause, resume, fork and rewind sessions: the gateway's side of snapshots.

A **pause** archives the session's /workspace and /tmp from inside its sandbox (kernels/snapshots/
archive.py) into a signed snapshot (kernels/snapshots/store.py), records the session as ``paused``
in the catalog and removes its container: its memory and CPU are given back, and the snapshot
outlives gateway restarts and reboots. A **resume** (asked for, or the next execute or file call)
starts a fresh sandbox of the recorded profile (fresh uid, fresh kernel key, the same egress
policy, every hardening of a new sandbox), puts the files back and rebuilds the memory by
re-running the cells that built it (notebooks/resume.py): ``restored_by: "replay"`` with a
verdict per cell, never passed off as exact. A **fork** does the same into ``count`` new sessions
of the same tenant, whose transcripts start with the parent's cells marked inherited; a
**rewind** pauses the session and resumes it as it was right after an earlier cell, and records
that in the transcript.

With memory snapshots on (``--memory-snapshots``: auto, the default, turns them on where the host
can) a gVisor session starts savable, and a pause or a fork also keeps
its kernel's memory (kernels/snapshots/memory.py): the resume or each fork carries on from it,
``restored_by: "checkpoint"``, no cell re-run (a fork's parent goes on running). Replay stays for
runc (its CRIU does not run on this kernel), for rewinds, and whenever the image could not be
saved or does not start, and says so: see docs/snapshots.md.

Each session has one lock here: a pause, resume, fork or rewind of a session waits for the one
before it, and the calls that resume by themselves (:meth:`SessionRegistry.live`) wait too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from stat import S_ISDIR
from typing import Any

import nbformat

from sandkernel.atomic import write_atomic
from sandkernel.errors import (
    ConfigError,
    SandkernelError,
    SessionBusyError,
    SnapshotError,
    SnapshotQuotaError,
    SnapshotRejectedError,
)
from sandkernel.gateway.adoption import managed_from_record
from sandkernel.gateway.managed import ManagedSession, PausedSession, now_iso, seconds_since
from sandkernel.gateway.registry import SessionRegistry
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.kernels.execution.adoption import profile_from_record, profile_record
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.model.profiles import Profile, Runtime
from sandkernel.kernels.model.records import SandboxKind, SandboxRecord, SandboxState
from sandkernel.kernels.sandbox.bulk_io import bulk_io
from sandkernel.kernels.sandbox.kernelspec import kernel_name_for
from sandkernel.kernels.sandbox.memory_checkpoint import SavedMemory
from sandkernel.kernels.sandbox.sparse_files import allocated
from sandkernel.kernels.sandbox.workspace_disk import KeptWorkspace
from sandkernel.kernels.snapshots.archive import ArchivePart, capture_files
from sandkernel.kernels.snapshots.disk import DISK, has_disk, seal_disk, unseal_disk
from sandkernel.kernels.snapshots.memory import has_memory, image_bound, scratch_dir, seal_image, unseal_image
from sandkernel.kernels.snapshots.quota import (
    CHECKPOINT_WINDOW_SECONDS,
    Allowance,
    TenantSnapshotBytes,
    WrittenInWindow,
)
from sandkernel.kernels.snapshots.store import SnapshotDraft, SnapshotManifest, SnapshotStore
from sandkernel.notebooks.compare import code_cells
from sandkernel.notebooks.recorder import TranscriptRecorder, notebook_path_for
from sandkernel.notebooks.resume import CHECKPOINT, Restored, carry_on, cells_in_memory, rebuild
from sandkernel.notebooks.transcript import build_notebook

log = logging.getLogger(__name__)

MiB = 1024 * 1024
MAX_FORKS = 10  # per request: each fork is a cold start plus a replay
FORKS_AT_ONCE = 4  # started concurrently: the engine and 2 cores do not gain from more
FILES = "files"  # the archive part of a snapshot
TRANSCRIPT = "transcript"  # a pause's copy of the session's transcript (the cells to replay elsewhere)
PAUSE = "pause"  # the kind of a pause's snapshot
FORK = "fork"  # the kind of a fork's (removed once the forks are made)
CELL = "cell"  # the kind of a per-cell checkpoint
RESTORE_PREFIX = "restore-"  # a memory image linked for runsc, in the store's root while it starts
RESTORE_STALE_SECONDS = 3600.0  # such a dir this old was left by a crash (a start takes seconds)


class SnapshotManager:
    """Pause, resume, fork and rewind for one gateway's registry."""

    def __init__(
        self,
        registry: SessionRegistry,
        settings: GatewaySettings,
        store: SnapshotStore | None = None,
        expire_elsewhere: Callable[[float], Awaitable[list[str]]] | None = None,
    ) -> None:
        """``expire_elsewhere`` (a cluster's: gateway/cluster/takeover.py) expires the sessions
        paused longer than the ttl given on hosts that are down and share this snapshot dir."""
        self.registry = registry
        self.expire_elsewhere = expire_elsewhere
        self.settings = settings
        self.store = store or SnapshotStore(settings.snapshot_dir)
        self._locks: dict[str, asyncio.Lock] = {}
        self._owners: dict[str, str] = {}  # session id -> tenant, for every lock made
        # Per tenant: its snapshot bytes, written ones counted as they are written (the quota),
        # and what its per-cell checkpoints wrote in the last minute.
        self._tenant_bytes: dict[str, TenantSnapshotBytes] = {}
        self._checkpoint_bytes: dict[str, WrittenInWindow] = {}

    def _lock(self, session_id: str, tenant: str) -> asyncio.Lock:
        """The session's lock; made only for a session already found to be ``tenant``'s."""
        self._owners[session_id] = tenant
        return self._locks.setdefault(session_id, asyncio.Lock())

    async def settled(self, session_id: str, tenant: str | None = None) -> None:
        """Return once no snapshot operation holds the session (``tenant``'s only: another
        tenant's call must not wait, which would tell it the id exists)."""
        lock = self._locks.get(session_id)
        if lock is not None and lock.locked() and tenant in (None, self._owners.get(session_id)):
            async with lock:
                pass

    # -- pause ------------------------------------------------------------------------------

    async def pause(self, managed: ManagedSession, door: str) -> dict[str, Any]:
        """Archive the session's files, record it paused and remove its container."""
        async with self._lock(managed.id, managed.tenant):
            started = time.monotonic()
            paused = await self._pause_locked(managed, PAUSE)
            managed.audit_record("session_paused", door=door, snapshot=paused.snapshot)
            self.registry.metrics.snapshot_ops.labels("pause").inc()
            return {
                "id": managed.id,
                "state": SandboxState.PAUSED.value,
                "snapshot": paused.snapshot,
                "seconds": round(time.monotonic() - started, 3),
            }

    async def _pause_locked(self, managed: ManagedSession, kind: str) -> PausedSession:
        live = self.registry.get(managed.tenant, managed.id)  # still this tenant's and live
        _check_idle(live)
        async with live.session.exclusive():  # no execute starts while the files are archived
            if live.checkpoints is not None:  # the last cell's checkpoint reads the sandbox the pause ends
                await live.checkpoints.settled()
            manifest = await self._snapshot(live, kind)
            # From here on it runs to its end (a stopping gateway waits for it): the session is
            # recorded paused, then its container goes.
            return await self.registry.finish(self._retire(live, manifest))

    async def _retire(self, live: ManagedSession, manifest: SnapshotManifest) -> PausedSession:
        session = live.session
        summary = _summary(manifest, await asyncio.to_thread(self.store.disk_bytes, manifest))
        kernel: dict[str, Any] = {"paused": summary, "profile": manifest.profile}
        if session.has_container:  # (a pause that kept the disk whole removed it already)
            kernel["previous"] = session.durable_state()
        record = SandboxRecord(
            live.id,
            SandboxKind.SESSION,
            kernel,
            state=SandboxState.PAUSED,
            tenant=live.tenant,
            gateway=live.gateway_record(paused_at=now_iso()),
        )
        # Live to paused with no await between: in between, the session counted for neither, and
        # a concurrent create or fork of its tenant could pass the limit (a benchmark saw it).
        paused = PausedSession(record)
        self.registry.take_live(live.id)
        self.registry.add_paused(paused)
        await self._put(record)
        await session.shutdown()
        kernel.pop("previous", None)  # the container is gone: nothing left to clean up at the next start
        await self._update(live.id, kernel=kernel)
        log.info("session paused", extra={"session": live.id, "tenant": live.tenant, "bytes": summary["bytes"]})
        return paused

    async def _snapshot(self, managed: ManagedSession, kind: str) -> SnapshotManifest:
        """Archive the live session's files and sign a manifest naming the cells in its memory.
        Every byte written is taken from the tenant's quota as it is written, shared with its
        other snapshots being written (kernels/snapshots/quota.py)."""
        quota = self.settings.snapshot_quota_mb * MiB
        tenant_bytes = self._tenant_bytes.setdefault(managed.tenant, TenantSnapshotBytes())
        used = await self._used(managed.tenant, tenant_bytes)
        if used >= quota and kind != CELL:  # a pause or a fork outranks the session's own cell checkpoints
            for old in await asyncio.to_thread(self.store.list, managed.id):
                if old.kind == CELL:
                    await bulk_io().run(managed.tenant, self.store.remove, managed.id, old.snapshot_id)
            used = await self._used(managed.tenant, tenant_bytes)
        if used >= quota:
            raise SnapshotQuotaError(
                f"this token's snapshots already use {used // MiB} MiB of its {quota // MiB} MiB quota "
                "(snapshots being written count too); delete paused sessions it no longer needs, or ask the "
                "operator for a larger --snapshot-quota-mb"
            )
        session = managed.session
        allowance = tenant_bytes.allowance(quota)
        draft = await asyncio.to_thread(self.store.draft, managed.id)
        kept = False
        # A pause of a savable sandbox with a disk workspace keeps the disk whole (after the
        # memory: the sandbox must have ended), a fork copies it whole (the parent goes on);
        # a cell's checkpoint, and every snapshot of other sandboxes, archives the files.
        disk_bytes = await session.workspace_disk_bytes() if kind in (PAUSE, FORK) and session.savable else None
        whole = disk_bytes is not None
        try:
            extra: dict[str, Any] = {}
            parts = (
                await self._keep_whole(session, managed.tenant, draft, allowance, extra, kind, disk_bytes)
                if whole
                else None
            )
            if parts is None:
                part = await capture_files(
                    session.container,
                    draft.part_path(FILES),
                    quota,
                    timeout=self.settings.pause_timeout,
                    allowance=allowance,
                )
                parts = {FILES: part}
            notebook = await _notebook_of(managed)
            if kind == PAUSE and managed.recorder is not None:
                # The transcript goes with the pause: another host resuming it (a shared snapshot
                # dir, its host down) replays its cells from this copy (gateway/cluster/takeover.py).
                text = managed.recorder.document().encode()
                if not allowance.take(len(text)):
                    raise SnapshotQuotaError(
                        f"the session's transcript ({len(text)} bytes) does not fit in what is left of this token's "
                        f"{quota // MiB} MiB snapshot quota; delete paused sessions it no longer needs"
                    )
                parts[TRANSCRIPT] = await asyncio.to_thread(self.store.write_part, draft, TRANSCRIPT, text)
            extra["cells_in_memory"] = cells_in_memory(notebook, lost_since=session.state_lost_pending)
            if session.savable and not whole:  # a fork's parent and a cell's session go on running
                saved = await self._save_memory(session, managed.tenant, draft, allowance, leave_running=kind != PAUSE)
                if saved is not None:
                    parts.update(saved[0])
                    extra["memory_uid"] = saved[1]  # signed with the rest: the restore runs as it
            manifest = SnapshotManifest(
                snapshot_id=draft.snapshot_id,
                session_id=managed.id,
                tenant=managed.tenant,
                kind=kind,
                created=time.time(),
                profile=profile_record(session.profile),
                cells=len(code_cells(notebook)),
                replay_from=0,
                cell=len(code_cells(notebook)) if kind == CELL else None,
                parts=parts,
                extra=extra,
            )
            if not allowance.claim():
                raise SnapshotQuotaError(
                    f"this token's other snapshots, started earlier, took the rest of its {quota // MiB} MiB snapshot "
                    "quota while this one was written; delete paused sessions it no longer needs"
                )
            committed = await asyncio.to_thread(self.store.commit, draft, manifest)
            kept = True
            return committed
        except BaseException:
            await bulk_io().run(managed.tenant, self.store.discard, draft)
            raise
        finally:
            allowance.settle(kept)

    async def _keep_whole(
        self,
        session: KernelSession,
        tenant: str,
        draft: SnapshotDraft,
        allowance: Allowance,
        extra: dict[str, Any],
        kind: str,
        reserved: int,
    ) -> dict[str, ArchivePart] | None:
        """A pause's memory and its workspace disk, whole (kernels/snapshots/disk.py), as parts
        (a fork's: the memory saved with the sandbox left running, and a copy of its disk taken
        with the filesystem frozen);
        the uid the saved kernel runs as goes into ``extra``. None when the quota has no room for
        the memory: nothing was tried, the sandbox runs, and its files are archived as for any
        snapshot. When gVisor fails the save (which may end the sandbox: a host socket makes its
        sentry panic), the disk is kept without the memory, and the resume replays the cells
        over the kept files. The disk's room is taken from the quota before the sandbox ends,
        so a pause over quota leaves the session running. ``reserved``: the disk's blocks now,
        the most its image can take."""
        if not allowance.take(reserved):
            raise SnapshotQuotaError(
                f"the session's workspace disk ({reserved // MiB} MiB) does not fit in what is left of this token's "
                f"{allowance.quota // MiB} MiB snapshot quota; delete paused sessions it no longer needs, or remove "
                "files"
            )
        bound = image_bound(session.profile.memory_mb)
        if not allowance.take(bound):
            allowance.give_back(reserved)
            log.warning("memory not saved: no room in the snapshot quota", extra={"session": session.id})
            return None
        allowance.give_back(bound)  # taken again, for good, as the image is written
        forking = kind == FORK
        # The disk's dirty data is written out while the memory is (WorkspaceDisk.flush).
        flushing = asyncio.ensure_future(session.flush_workspace_disk(tenant))
        try:
            saved = await self._checkpoint_memory(session, tenant, draft, allowance, leave_running=forking)
        finally:
            await flushing
        # The image is hashed while the disk is kept and hashed: both hashes take a core each.
        sealing = asyncio.ensure_future(self._sealed_memory(session, tenant, draft, allowance)) if saved else None
        try:
            if forking:
                extra["disk_uid"] = await session.copy_workspace_disk(draft.part_path(DISK), tenant)
            else:
                extra["disk_uid"] = await session.keep_workspace_disk(draft.part_path(DISK), tenant)
            if extra["disk_uid"] is None:
                allowance.give_back(reserved)
                outcome = "no fork was made" if forking else "it was not paused"
                raise SnapshotError(f"session {session.id}: its workspace disk could not be kept; {outcome}")
            disk = await bulk_io().run(tenant, seal_disk, draft)
        except BaseException:
            if sealing is not None:  # never left hashing a draft that is being discarded
                await asyncio.gather(sealing, return_exceptions=True)
            raise
        kept_bytes = allocated(await asyncio.to_thread(os.lstat, draft.part_path(DISK)))
        allowance.give_back(max(0, reserved - kept_bytes))
        memory_parts = await sealing if sealing is not None else None
        if saved is None or memory_parts is None:
            return {DISK: disk}
        extra["memory_uid"] = saved.uid
        return {DISK: disk, **memory_parts}

    async def _save_memory(
        self, session: KernelSession, tenant: str, draft: SnapshotDraft, allowance: Allowance, *, leave_running: bool
    ) -> tuple[dict[str, ArchivePart], int] | None:
        """The kernel's memory as snapshot parts (kernels/snapshots/memory.py) and the uid it runs
        as, its bound taken from the quota first; None when it cannot be saved (no room, or gVisor
        failed): the pause goes on, and its resume replays the cells as for runc. The sandbox ends
        either way unless ``leave_running`` (a fork's parent)."""
        saved = await self._checkpoint_memory(session, tenant, draft, allowance, leave_running=leave_running)
        parts = await self._sealed_memory(session, tenant, draft, allowance) if saved else None
        return None if saved is None or parts is None else (parts, saved.uid)

    async def _checkpoint_memory(
        self, session: KernelSession, tenant: str, draft: SnapshotDraft, allowance: Allowance, *, leave_running: bool
    ) -> SavedMemory | None:
        """:meth:`_save_memory`'s first step: the image written into the draft's scratch dir, its
        bound taken from the quota (give it back with :meth:`_sealed_memory`); None when it was not."""
        bound = image_bound(session.profile.memory_mb)
        if not allowance.take(bound):
            log.warning("memory not saved: no room in the snapshot quota", extra={"session": session.id})
            return None
        try:
            return await session.save_memory(scratch_dir(draft), leave_running=leave_running)
        except (SandkernelError, OSError) as err:
            await self._unsaved(session, tenant, draft, allowance, err)
            return None

    async def _sealed_memory(
        self, session: KernelSession, tenant: str, draft: SnapshotDraft, allowance: Allowance
    ) -> dict[str, ArchivePart] | None:
        """:meth:`_save_memory`'s second step: the written image hashed into parts, and what its
        bound took beyond them given back; None (all of it given back) when that failed."""
        bound = image_bound(session.profile.memory_mb)
        try:
            parts = await bulk_io().run(tenant, seal_image, draft)
        except (SandkernelError, OSError) as err:
            await self._unsaved(session, tenant, draft, allowance, err)
            return None
        allowance.give_back(bound - sum(part.bytes for part in parts.values()))
        return parts

    @staticmethod
    async def _unsaved(
        session: KernelSession, tenant: str, draft: SnapshotDraft, allowance: Allowance, err: Exception
    ) -> None:
        """A memory image that was not saved: its bound given back, its scratch dir removed."""
        allowance.give_back(image_bound(session.profile.memory_mb))
        await bulk_io().run(tenant, shutil.rmtree, scratch_dir(draft), True)
        log.warning("memory not saved (the resume replays): %s", err, extra={"session": session.id})

    async def _unsealed(self, manifest: SnapshotManifest, profile: Profile) -> SavedMemory | None:
        """The snapshot's memory image, checked and linked into a directory of its own for runsc
        (remove it with :meth:`_done_with`), or None when it has none or ``profile`` cannot take
        it. An altered image is refused (SnapshotRejectedError): nothing of it is loaded."""
        uid = manifest.extra.get("memory_uid")
        if not has_memory(manifest) or not isinstance(uid, int) or profile.runtime is not Runtime.RUNSC:
            return None
        target = self._scratch()
        return SavedMemory(await bulk_io().run(manifest.tenant, unseal_image, self.store, manifest, target), uid)

    def _scratch(self) -> Path:
        """A new path in the store's root for a restore's files while a sandbox starts (not a
        session id: sweeps skip it; a restart sweeps what a crash left, by its prefix)."""
        return self.store.root / f"{RESTORE_PREFIX}{uuid.uuid4().hex}"

    @staticmethod
    async def _done_with(memory: SavedMemory | None, tenant: str) -> None:
        if memory is not None:
            await bulk_io().run(tenant, shutil.rmtree, memory.image_dir, True)

    async def _start_session(
        self,
        profile: Profile,
        session_id: str,
        tenant: str,
        memory: SavedMemory | Awaitable[SavedMemory | None] | None,
        disk_of: SnapshotManifest | None = None,
    ) -> tuple[KernelSession, bool]:
        """A sandbox for a resume or a fork: carrying on from ``memory`` when there is one and it
        starts, else a fresh one to replay into; with ``disk_of``'s workspace disk, a checked copy
        of its own for each try (a fork's children start at once). Whether it came from memory.
        ``memory`` may still be being checked (a resume's): it is awaited once the disk's copy
        is made, and an image that fails its check (SnapshotRejectedError) starts nothing."""
        if memory is not None:
            saved: SavedMemory | None = None
            try:
                async with self._kept(disk_of) as kept:
                    saved = memory if isinstance(memory, SavedMemory) else await memory
                    if saved is not None:
                        return await self.registry.cold_start(
                            profile, session_id, tenant, restore=saved, kept=kept
                        ), True
                    return await self.registry.cold_start(profile, session_id, tenant, kept=kept), False
            except SnapshotRejectedError:
                raise
            except SandkernelError as err:
                if saved is None:
                    raise
                log.warning("memory image did not start (replaying instead): %s", err, extra={"session": session_id})
        async with self._kept(disk_of) as kept:
            return await self.registry.cold_start(profile, session_id, tenant, kept=kept), False

    @contextlib.asynccontextmanager
    async def _kept(self, manifest: SnapshotManifest | None) -> AsyncIterator[KeptWorkspace | None]:
        """A checked copy of the snapshot's workspace disk, with its files' uid, in a directory of
        its own for as long as a start takes it (its start moves it out); None without one."""
        if manifest is None:
            yield None
            return
        uid = manifest.extra.get("disk_uid")
        if isinstance(uid, bool) or not isinstance(uid, int):
            raise SnapshotRejectedError(f"snapshot {manifest.snapshot_id} keeps a workspace disk but not its owner")
        scratch = self._scratch()
        await asyncio.to_thread(scratch.mkdir, 0o700)
        try:
            yield KeptWorkspace(await bulk_io().run(manifest.tenant, unseal_disk, self.store, manifest, scratch), uid)
        finally:
            await bulk_io().run(manifest.tenant, shutil.rmtree, scratch, True)

    async def _used(self, tenant: str, tenant_bytes: TenantSnapshotBytes) -> int:
        """The tenant's snapshot bytes: committed (walked again) and being written."""
        return await asyncio.to_thread(tenant_bytes.refresh, lambda: self.store.tenant_bytes(tenant))

    # -- resume -----------------------------------------------------------------------------

    async def resume(self, tenant: str, session_id: str, door: str) -> dict[str, Any]:
        """Bring a paused session back (a live one: nothing to do, ``restored_by`` null)."""
        if self._owners.get(session_id) != tenant:
            self.registry.find(tenant, session_id)  # 404 before any lock is made for another's id
        async with self._lock(session_id, tenant):
            paused = self.registry.paused(tenant, session_id)
            if paused is None:
                managed = self.registry.get(tenant, session_id)  # 404 / 410 as for any call
                return {"id": managed.id, "state": SandboxState.RUNNING.value, "restored_by": None}
            managed, restored = await self._resume_locked(paused, door)
            return {"id": managed.id, "state": SandboxState.RUNNING.value, **restored.to_dict()}

    async def _resume_locked(
        self, paused: PausedSession, door: str, rewind_to: int | None = None
    ) -> tuple[ManagedSession, Restored]:
        # It counts for its tenant while paused; its sandbox needs room in the gateway's total.
        async with self.registry.reserved(paused.tenant, counted=True):
            return await self._resume_reserved(paused, door, rewind_to)

    async def _resume_reserved(
        self, paused: PausedSession, door: str, rewind_to: int | None
    ) -> tuple[ManagedSession, Restored]:
        snapshot_id = str(paused.snapshot.get("id", ""))
        manifest = await asyncio.to_thread(self.store.load, paused.id, snapshot_id, paused.tenant)
        recorder = await _reopen_transcript(paused.record.gateway.get("transcript"))
        notebook = recorder.notebook if recorder is not None else build_notebook([], {})
        source: SnapshotManifest | None = manifest
        if rewind_to is None:
            cells, files, files_from = (
                list(manifest.extra.get("cells_in_memory") or []),
                self._files(manifest),
                "snapshot",
            )
        else:
            cells, files, files_from, source = await self._state_after(paused.id, paused.tenant, notebook, rewind_to)
        profile = self._profile_now(profile_from_record(manifest.profile), paused.id, "stays paused")
        # The memory image is checked while the disk is copied and checked (_start_session).
        checking = asyncio.ensure_future(self._unsealed(source, profile)) if source is not None else None
        disk_of = source if source is not None and has_disk(source) else None
        try:
            session, from_memory = await self._start_session(profile, paused.id, paused.tenant, checking, disk_of)
        finally:
            await self._done_with(await _outcome(checking), paused.tenant)
        try:
            with self._gated(session, paused.tenant):
                if from_memory:
                    restored = await carry_on(session, files, files_from)
                else:
                    restored = await rebuild(
                        session,
                        notebook,
                        cells=cells,
                        files=files,
                        files_from=files_from,
                        files_in_place=disk_of is not None,
                        **self._replay_rules(),
                    )
        except BaseException as err:
            await self.registry.finish(session.shutdown())
            if isinstance(err, SnapshotError):
                raise
            raise SnapshotError(
                f"session {paused.id} could not be resumed ({err}); it stays paused and its snapshot is kept"
            ) from err
        managed = managed_from_record(session, paused.record, recorder)
        if recorder is not None:
            await self.registry.wiring.transcript(session, recorder)
            if rewind_to is not None:
                await recorder.add_markdown(
                    f"> **sandkernel:** rewound to cell {rewind_to}: the state is again the one right after it "
                    f"({_said(restored)}); the cells below it above this note no longer count",
                    role="event",
                    rewind={"to": rewind_to},
                )
            else:
                await recorder.note(f"resumed from a pause ({_said(restored)})")
        await self.registry.record(managed)
        self.registry.add_live(managed)
        if managed.breaker is not None:  # a quarantine outlives a pause, as it outlives a restart
            managed.breaker.restore(paused.record.gateway.get("quarantined"))
        await self._remove_later(paused.tenant, paused.id, manifest.snapshot_id)
        self.registry.metrics.snapshot_ops.labels("resume" if rewind_to is None else "rewind").inc()
        managed.audit_record(
            "session_resumed" if rewind_to is None else "session_rewound",
            door=door,
            restored_by=restored.restored_by,
            reproduced=restored.reproduced,
            files=restored.files,
            **({"cell": rewind_to} if rewind_to is not None else {}),
        )
        log.info("session resumed", extra={"session": managed.id, "tenant": managed.tenant})
        return managed, restored

    def _gated(self, session: KernelSession, tenant: str) -> contextlib.AbstractContextManager[None]:
        """Replayed cells pass the operator's gates and are audited, as new code is."""
        return self.registry.wiring.on_replay(session, tenant)

    def _profile_now(self, recorded: Profile, session_id: str, outcome: str) -> Profile:
        """The profile a session starts again with: the operator's current settings, its
        tenant's choices checked again (ProfileCatalog.recheck). A session its snapshot would
        carry past settings the operator has since narrowed is refused (409), saying what."""
        try:
            return self.registry.catalog.recheck(recorded)
        except ConfigError as err:
            raise SnapshotError(
                f"session {session_id} no longer fits this gateway's settings ({err}); it {outcome}: delete it, "
                "or ask the operator to offer its settings again"
            ) from err

    def _files(self, manifest: SnapshotManifest) -> tuple[Path, Any] | None:
        """The snapshot's files archive, None when it keeps a whole disk instead (or nothing)."""
        if FILES not in manifest.parts:
            return None
        return self.store.part_path(manifest, FILES), manifest.parts[FILES]

    async def _state_after(
        self, session_id: str, tenant: str, notebook: nbformat.NotebookNode, cell: int
    ) -> tuple[list[int], tuple[Path, Any] | None, str, SnapshotManifest | None]:
        """What rebuilds the state right after code cell ``cell``: the cells in memory then, and
        the files from that cell's checkpoint if one is kept (else the cells remake them on a
        fresh workspace: ``replay``), and that checkpoint (its memory image, if it has one, makes
        the cells unnecessary)."""
        kept = await asyncio.to_thread(self.store.list, session_id)
        for manifest in reversed(kept):
            if manifest.kind == CELL and manifest.cell == cell and manifest.tenant == tenant:
                cells = list(manifest.extra.get("cells_in_memory") or [])
                return cells, self._files(manifest), "checkpoint", manifest
        return cells_in_memory(notebook, after=cell), None, "replay", None

    # -- a paused session of another host (a shared snapshot dir) ------------------------------

    async def check_movable(self, record: SandboxRecord) -> SnapshotManifest:
        """The verified snapshot of a paused session another host paused, before this host takes
        it over: SnapshotRejectedError when this store cannot resume it (not there, signed with
        another key, no transcript copy where the session keeps one)."""
        snapshot_id = str(PausedSession(record).snapshot.get("id", ""))
        manifest = await asyncio.to_thread(self.store.load, record.session_id, snapshot_id, record.tenant or "")
        if record.gateway.get("transcript") and TRANSCRIPT not in manifest.parts:
            raise SnapshotRejectedError(
                f"snapshot {snapshot_id} of session {record.session_id} has no copy of its transcript (taken by an "
                "older sandkernel); it can only be resumed on the host that paused it"
            )
        return manifest

    async def moved_here(self, record: SandboxRecord, manifest: SnapshotManifest, from_host: str) -> PausedSession:
        """Take in a paused session this host now holds (taken over from a host that is down):
        its transcript from the snapshot into this host's notebook dir, the record saying so;
        from then on it is paused here like one of this host's own."""
        gateway = {**record.gateway, "moved_from": from_host}  # for the operator reading the catalog
        if TRANSCRIPT in manifest.parts:
            path = notebook_path_for(record.session_id, self.settings.notebook_dir)
            try:
                data = await asyncio.to_thread(self.store.read_part, manifest, TRANSCRIPT)
                await asyncio.to_thread(write_atomic, path, data)
                gateway["transcript"] = str(path)
            except (OSError, SnapshotError) as err:  # the resume then says it cannot replay
                log.error("the transcript of a taken-over session could not be restored: %s", err)
        record = dataclasses.replace(record, gateway=gateway)
        paused = PausedSession(record)
        self.registry.add_paused(paused)  # the catalog already says it is this host's: serve it
        try:
            await self._update(record.session_id, gateway=gateway)
        except Exception as err:  # its resume records it whole again
            log.warning("the record of a taken-over session was not updated: %s", err)
        log.info(
            "paused session taken over from a host that is down",
            extra={"session": record.session_id, "tenant": record.tenant, "from_host": from_host},
        )
        return paused

    # -- per-cell checkpoints ------------------------------------------------------------------

    async def checkpoint(self, managed: ManagedSession) -> SnapshotManifest:
        """Archive the files as the last cell left them, and drop the oldest checkpoints beyond
        ``checkpoints_kept``. Takes no lock: a pause may be waiting for it (gateway/checkpoints.py).
        SnapshotQuotaError when the tenant's checkpoints wrote ``checkpoint_mb_per_minute`` in
        the last minute (the cell goes on without one)."""
        written = self._checkpoint_bytes.setdefault(managed.tenant, WrittenInWindow(CHECKPOINT_WINDOW_SECONDS))
        limit = self.settings.checkpoint_mb_per_minute * MiB
        if written.total() >= limit:
            raise SnapshotQuotaError(
                f"this token's per-cell checkpoints wrote {written.total() // MiB} MiB in the last minute, the most "
                f"--checkpoint-mb-per-minute ({limit // MiB}) allows; this cell has none"
            )
        manifest = await self._snapshot(managed, CELL)
        written.add(manifest.bytes)
        kept = [m for m in await asyncio.to_thread(self.store.list, managed.id) if m.kind == CELL]
        for old in kept[: max(0, len(kept) - self.settings.checkpoints_kept)]:
            await bulk_io().run(managed.tenant, self.store.remove, managed.id, old.snapshot_id)
        return manifest

    # -- rewind -----------------------------------------------------------------------------

    async def rewind(self, managed: ManagedSession, cell: Any, door: str) -> dict[str, Any]:
        """Return the session to its state right after code cell ``cell``: pause it, then resume
        it with the cells that made that state (on a fresh workspace: the files of that moment are
        the cells' doing). A failure leaves it paused as it was before the rewind."""
        async with self._lock(managed.id, managed.tenant):
            notebook = await _notebook_of(managed)
            _check_cell(cell, len(code_cells(notebook)))
            paused = await self._pause_locked(managed, PAUSE)
            _, restored = await self._resume_locked(paused, door, rewind_to=cell)
            return {"id": managed.id, "state": SandboxState.RUNNING.value, "rewound_to": cell, **restored.to_dict()}

    # -- fork -------------------------------------------------------------------------------

    async def fork(self, managed: ManagedSession, count: Any, cell: Any, door: str) -> list[dict[str, Any]]:
        """``count`` new sessions of the same tenant with the session's state (now, or right after
        code cell ``cell``). Either all are made or none (those started are removed)."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
            raise ConfigError(f"count must be a whole number of forks from 1 to {MAX_FORKS}, not {count!r}")
        # Room for every fork is held from here until they are live (or failed), here and in the
        # cluster's catalog: concurrent forks cannot each pass one check.
        async with self.registry.reserved(managed.tenant, count):
            return await self._fork_reserved(managed, count, cell, door)

    async def _fork_reserved(self, managed: ManagedSession, count: int, cell: Any, door: str) -> list[dict[str, Any]]:
        async with self._lock(managed.id, managed.tenant):
            notebook = await _notebook_copy(managed)
            total = len(code_cells(notebook))
            manifest = None  # the fork's own snapshot, removed once the forks are made
            if cell is None:
                _check_idle(managed)
                async with managed.session.exclusive():
                    manifest = source = await self._snapshot(managed, FORK)
                cells, files, upto = list(manifest.extra["cells_in_memory"]), self._files(manifest), total
                files_from = "snapshot"
            else:
                _check_cell(cell, total)
                cells, files, files_from, source = await self._state_after(managed.id, managed.tenant, notebook, cell)
                upto = cell
            profile = self._profile_now(managed.session.profile, managed.id, "was not forked")
        limit = asyncio.Semaphore(FORKS_AT_ONCE)
        memory = None
        disk_of = source if source is not None and has_disk(source) else None

        async def one() -> tuple[ManagedSession, Restored]:
            async with limit:
                return await self._child(managed, profile, notebook, cells, (files, files_from), upto, memory, disk_of)

        try:
            if source is not None:  # every fork starts from the one image, checked once
                memory = await self._unsealed(source, profile)
            outcomes = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
        finally:
            await self._done_with(memory, managed.tenant)
            if manifest is not None:
                await self._remove_later(managed.tenant, managed.id, manifest.snapshot_id)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        made = [o for o in outcomes if not isinstance(o, BaseException)]
        if failed:
            for child, _ in made:
                await self.registry.delete(child.tenant, child.id, reason="fork failed")
            raise SnapshotError(f"the fork failed ({failed[0]}); no fork was kept") from failed[0]
        self.registry.metrics.snapshot_ops.labels("fork").inc(count)
        managed.audit_record("session_forked", door=door, forks=[c.id for c, _ in made], cell=cell)
        return [{"session": child.session_model(), **restored.to_dict()} for child, restored in made]

    async def _child(
        self,
        parent: ManagedSession,
        profile: Any,
        notebook: nbformat.NotebookNode,
        cells: list[int],
        files: tuple[tuple[Path, Any] | None, str],
        upto: int,
        memory: SavedMemory | None,
        disk_of: SnapshotManifest | None,
    ) -> tuple[ManagedSession, Restored]:
        session_id = uuid.uuid4().hex
        session, from_memory = await self._start_session(profile, session_id, parent.tenant, memory, disk_of)
        try:
            with self._gated(session, parent.tenant):
                if from_memory:
                    restored = await carry_on(session, files[0], files[1])
                else:
                    restored = await rebuild(
                        session,
                        notebook,
                        cells=cells,
                        files=files[0],
                        files_from=files[1],
                        files_in_place=disk_of is not None,
                        **self._replay_rules(),
                    )
            metadata = {**parent.metadata, "forked_from": parent.id}
            recorder = TranscriptRecorder(
                notebook_path_for(session_id, self.settings.notebook_dir),
                {"tenant": parent.tenant, "client_metadata": metadata, "forked_from": parent.id},
            )
            recorder.inherit(notebook, parent.id, upto)
            await self.registry.wiring.transcript(session, recorder)
            await recorder.note(f"forked from session {parent.id} after its cell {upto} ({_said(restored)})")
            child = ManagedSession(
                session,
                parent.tenant,
                now_iso(),
                metadata,
                kernel_name_for(session.profile.runtime),
                origin=parent.origin,
                recorder=recorder,
                lifetime_from=parent.lifetime_from or parent.created,
                created_mono=parent.created_mono,  # --max-lifetime counts from the parent's start
            )
            await self.registry.record(child)
        except BaseException:
            await self.registry.finish(session.shutdown())
            raise
        self.registry.add_live(child)
        child.audit_record("session_created", door="fork", forked_from=parent.id, runtime=profile.runtime.value)
        return child, restored

    # -- housekeeping -----------------------------------------------------------------------

    async def forget(self, session_id: str) -> None:
        """Remove every snapshot of a session (it was deleted), in its tenant's lane of the bulk
        file threads (one lane for sessions whose tenant this process never saw)."""
        await bulk_io().run(self._owners.get(session_id, ""), self.store.remove, session_id)
        self._locks.pop(session_id, None)
        self._owners.pop(session_id, None)

    async def expire(self) -> list[str]:
        """Delete paused sessions older than ``paused_ttl`` (seconds paused); their ids."""
        ttl = self.settings.paused_ttl
        if ttl is None:
            return []
        expired = [p for p in self.registry.paused_sessions() if seconds_since(p.record.gateway.get("paused_at")) > ttl]
        for paused in expired:
            log.info("paused session expired", extra={"session": paused.id, "tenant": paused.tenant})
            await self.registry.delete(paused.tenant, paused.id, reason="paused_ttl")
        gone = [p.id for p in expired]
        if self.expire_elsewhere is not None:  # and those of down hosts sharing this snapshot dir
            gone += await self.expire_elsewhere(ttl)
        return gone

    async def sweep(self) -> list[str]:
        """Remove snapshots of sessions the registry does not know (a crash mid-pause, a record
        deleted by hand): run at start-up, after adoption."""
        await asyncio.to_thread(self._remove_restore_dirs)
        await asyncio.to_thread(self.store.empty_all)
        known = {p.id for p in self.registry.paused_sessions()} | self.registry.live_ids()
        orphans = [sid for sid in await asyncio.to_thread(self.store.sessions) if sid not in known]
        cluster = self.registry.cluster
        if cluster is not None and orphans:
            # A snapshot dir the hosts share holds the others' paused sessions too: only the
            # snapshots of sessions no host records go (a catalog that cannot say: none go).
            try:
                recorded = await cluster.catalog.known_sessions(orphans)
            except Exception as err:
                log.warning("snapshots not swept: the cluster catalog could not say whose they are: %s", err)
                return []
            orphans = [sid for sid in orphans if sid not in recorded]
        for session_id in orphans:
            await asyncio.to_thread(self.store.remove, session_id)
        return orphans

    def _replay_rules(self) -> dict[str, Any]:
        """What the operator's settings say a replay may do (notebooks/resume.py's rebuild)."""
        return {"refuse_side_effects": self.settings.replay_side_effects == "refuse"}

    async def _remove_later(self, tenant: str, session_id: str, snapshot_id: str) -> None:
        """Take a snapshot that was used up out of the store now (SnapshotStore.take_out) and
        delete its files after the answer, in the tenant's lane of the bulk file threads."""
        trash = await asyncio.to_thread(self.store.take_out, session_id, snapshot_id)
        if trash is not None:
            self.registry.finish_later(bulk_io().run(tenant, self.store.empty, trash))

    def _remove_restore_dirs(self) -> None:
        """Memory images linked (and workspace disks copied) for a start that a crash interrupted.
        Only stale ones: in a cluster the snapshot dir is shared, and another host may be
        starting from one now."""
        for entry in self.store.root.glob(f"{RESTORE_PREFIX}*"):
            stat = entry.lstat()
            if S_ISDIR(stat.st_mode) and time.time() - stat.st_mtime > RESTORE_STALE_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)

    async def _put(self, record: SandboxRecord) -> None:
        if self.registry.store is not None:
            if self.registry.writer is not None:
                await self.registry.writer.flush()
            await self.registry.store.put(record)

    async def _update(self, session_id: str, **fields: Any) -> None:
        if self.registry.store is not None:
            await self.registry.store.update(session_id, **fields)


async def _outcome(checking: asyncio.Future[SavedMemory | None] | None) -> SavedMemory | None:
    """What a memory check gave once it ends (waited for even when the start failed first, so
    no thread is left linking an image), None when it failed: its error was raised where the
    start awaited it."""
    if checking is None:
        return None
    try:
        return await checking
    except Exception:
        return None


def _summary(manifest: SnapshotManifest, on_disk: int) -> dict[str, Any]:
    return {"id": manifest.snapshot_id, "bytes": on_disk, "cells": manifest.cells, "created": manifest.created}


def _said(restored: Restored) -> str:
    if restored.restored_by == CHECKPOINT:
        return f"restored from a memory checkpoint: no cell re-run; files from the {restored.files}"
    ran = sum(1 for v in restored.verdicts if v.verdict.value != "not run")
    agreed = "every one as recorded" if restored.reproduced else "some differ from the record: see the reply"
    return f"restored by replay: {ran} cell(s) re-run, {agreed}; files from the {restored.files}"


def _check_idle(managed: ManagedSession) -> None:
    if managed.session.busy:
        raise SessionBusyError(f"session {managed.id} is running code; wait for it or interrupt it first")


def _check_cell(cell: Any, total: int) -> None:
    if isinstance(cell, bool) or not isinstance(cell, int) or not 1 <= cell <= total:
        raise ConfigError(f"cell must be the number of a code cell of this session, 1 to {total}, not {cell!r}")


async def _notebook_of(managed: ManagedSession) -> nbformat.NotebookNode:
    """The session's transcript as recorded so far (an empty one when it keeps none)."""
    if managed.recorder is None:
        return build_notebook([], {})
    await managed.recorder.flushed()
    return managed.recorder.notebook


async def _notebook_copy(managed: ManagedSession) -> nbformat.NotebookNode:
    """A copy of the session's transcript that later cells do not change: its text joined on
    the loop (linear), parsed in a thread (a deepcopy on the loop of a 50,000-cell transcript
    held every other tenant's requests for seconds)."""
    if managed.recorder is None:
        return build_notebook([], {})
    await managed.recorder.flushed()
    return await asyncio.to_thread(nbformat.reads, managed.recorder.document(), as_version=nbformat.NO_CONVERT)


async def _reopen_transcript(path: Any) -> TranscriptRecorder | None:
    if not isinstance(path, str):
        return None
    return await asyncio.to_thread(TranscriptRecorder.reopen, Path(path))
