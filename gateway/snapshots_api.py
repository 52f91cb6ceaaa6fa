"""``POST /api/sessions/{id}/pause|resume|fork|rewind``: the session API's doors to snapshots
(gateway/snapshots.py does the work; this module reads and checks the request)."""

from __future__ import annotations

from sandkernel import doors
from sandkernel.gateway.http_api import ApiError
from sandkernel.gateway.sessions_api import SessionScoped


class SnapshotActionHandler(SessionScoped):
    """POST pause (200 {id, state, snapshot, seconds}), resume (200 {id, state, restored_by,
    cells, files, ...}), fork {count, cell?} (201 {forks: [...]}) or rewind {cell} (200)."""

    async def post(self, session_id: str, action: str) -> None:
        snapshots = self.registry.snapshots
        if snapshots is None:
            raise ApiError(501, "this gateway keeps no snapshots", "not_supported")
        if action == "resume":
            self.write_json(await snapshots.resume(self.tenant, session_id, doors.SESSION_API))
            return
        body = self.json_body()
        if action == "pause":
            self.write_json(await snapshots.pause(self.managed(session_id), doors.SESSION_API))
        elif action == "fork":
            managed = await self.live(session_id)
            forks = await snapshots.fork(managed, body.get("count", 1), body.get("cell"), doors.SESSION_API)
            self.write_json({"forks": forks}, status=201)
        else:
            if "cell" not in body:
                raise ApiError(400, 'rewind needs {"cell": N}: the code cell whose state to return to')
            managed = await self.live(session_id)
            self.write_json(await snapshots.rewind(managed, body["cell"], doors.SESSION_API))
