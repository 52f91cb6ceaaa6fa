"""Workspace files and variables of a session: upload, download, list, and a namespace listing.

File I/O happens inside the sandbox (see kernels/sandbox/workspace_files.py); this module only maps
requests onto it. The sandbox's refusals (WorkspaceFileError: not_found, bad_path, not_regular,
too_large, ...) and every other SandkernelError reach the client through base.py's one mapping,
each with its own status (a closed session is a 404, a missing container too; never a blanket 503)."""

from __future__ import annotations

from sandkernel.doors import SESSION_API
from sandkernel.gateway.http_api import ApiError
from sandkernel.gateway.sessions_api import SessionScoped
from sandkernel.kernels.sandbox.workspace_files import MAX_FILE_BYTES


class FilesHandler(SessionScoped):
    """GET …/files?path=DIR lists; GET …/files/PATH downloads; PUT …/files/PATH uploads (raw body)."""

    async def get(self, session_id: str, path: str | None = None) -> None:
        managed = await self.live(session_id)
        if path is None:
            self.write_json(await self.service.list_files(managed, self.get_query_argument("path", "")))
            return
        data = await self.service.read_file(managed, path)
        self.set_header("Content-Type", "application/octet-stream")
        self.set_header("Content-Disposition", f'attachment; filename="{path.rsplit("/", 1)[-1]}"')
        self.finish(data)

    async def put(self, session_id: str, path: str | None = None) -> None:
        if path is None:
            raise ApiError(400, "PUT needs a file path: /api/sessions/{id}/files/{path}")
        if len(self.body) > MAX_FILE_BYTES:
            raise ApiError(413, f"upload is over the limit of {MAX_FILE_BYTES} bytes", "too_large")
        written = await self.service.write_file(await self.live(session_id), SESSION_API, path, self.body)
        self.write_json(written, status=201)


class VariablesHandler(SessionScoped):
    async def get(self, session_id: str) -> None:
        self.write_json(await self.service.variables(self.managed(session_id)))


class EgressHandler(SessionScoped):
    """GET the session's egress audit: its policy and every request, allowed or refused."""

    def get(self, session_id: str) -> None:
        session = self.managed(session_id).session
        records = session.egress_records()
        network = session.profile.network
        self.write_json(
            {
                "policy": network.to_dict() if network else "none",
                "records": records or [],
                "summary": session.provisioner.egress.summary() if network and session.provisioner.egress else None,
            }
        )
