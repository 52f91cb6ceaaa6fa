"""The Jupyter-compatible kernel API: what jupyter_server's GatewayClient (JupyterLab with
``--gateway-url``) and other standard clients call. Every kernel is a sandkernel session."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sandkernel import __version__
from sandkernel.doors import KERNEL_API
from sandkernel.gateway.base import BaseHandler
from sandkernel.gateway.http_api import ApiError
from sandkernel.gateway.managed import ManagedSession, record_model
from sandkernel.kernels.model.profiles import Runtime
from sandkernel.kernels.model.records import SandboxRecord, SandboxState
from sandkernel.kernels.sandbox.kernelspec import KERNEL_NAMES, kernel_json, kernel_name_for

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


def kernelspec_model(name: str) -> dict[str, Any]:
    spec = kernel_json(name)
    spec.pop("env", None)
    return {"name": name, "spec": spec, "resources": {}}


class ApiRootHandler(BaseHandler):
    def get(self) -> None:
        self.write_json({"version": "2.0.0", "sandkernel": __version__})


async def offered_kernel_names(handler: BaseHandler) -> list[str]:
    """The kernelspecs a tenant may start: those whose runtime the default profile offers and, in
    a cluster, that some up host runs. A create through any gateway is placed cluster-wide, so
    the gVisor kernelspec is listed when any up host has gVisor, whether this one has it or not,
    and none is listed that no up host could start (JupyterLab would offer a kernel whose every
    create is refused). When the catalog cannot be read now, the profile's list alone: a create
    then says why it fails."""
    offered = handler.registry.catalog.ceilings["default"].runtimes
    names = [name for name, runtime in KERNEL_NAMES.items() if Runtime(runtime) in offered]
    router = handler.router
    runnable = await router.runtimes() if router is not None else None
    return names if runnable is None else [name for name in names if KERNEL_NAMES[name] in runnable]


def default_kernel_name(handler: BaseHandler) -> str:
    """The kernelspec of the default profile's runtime (gVisor where the operator chose it)."""
    return kernel_name_for(handler.registry.catalog.profile("default").runtime)


class KernelSpecsHandler(BaseHandler):
    async def get(self) -> None:
        names = await offered_kernel_names(self)
        self.write_json({"default": default_kernel_name(self), "kernelspecs": {n: kernelspec_model(n) for n in names}})


class KernelSpecHandler(BaseHandler):
    async def get(self, name: str) -> None:
        offered = await offered_kernel_names(self)
        if name not in offered:
            raise ApiError(404, f"no kernelspec {name[:64]!r}; available: {offered}")
        self.write_json(kernelspec_model(name))


class KernelsHandler(BaseHandler):
    """GET the tenant's kernels (in a cluster: on every host); POST a new one (in a cluster: placed
    like a session, on the host with most room that runs its runtime: gateway/cluster/placement.py)."""

    async def get(self) -> None:
        local = self.registry.list(self.tenant)
        models = [managed.kernel_model() for managed in local]
        cluster = self.cluster
        if cluster is not None and self.forwarded_from is None:
            here = {managed.id for managed in local}
            records = await cluster.tenant_sessions(self.tenant)
            models += [recorded_kernel_model(r) for r in records if r.session_id not in here and is_live(r)]
        self.write_json(models)

    async def post(self) -> None:
        body = self.json_body()
        name = body.get("name") or default_kernel_name(self)
        if not isinstance(name, str) or name not in KERNEL_NAMES:
            shown = name[:64] if isinstance(name, str) else name
            raise ApiError(400, f"unknown kernel name {shown!r}; use one of {sorted(KERNEL_NAMES)}", "unknown_kernel")
        limits = {"runtime": KERNEL_NAMES[name]}
        managed = await self.create_session(None, limits, {"name": "kernel"}, origin="kernel_api")
        if managed is None:  # placed on another host, which answered
            return
        self.set_header("Location", f"/api/kernels/{managed.session.kernel_id}")
        self.write_json(managed.kernel_model(), status=201)


def is_live(record: SandboxRecord) -> bool:
    """Whether a catalogued session has a kernel to list: running ones only (a lost or paused
    session has none, as on the host that holds it: registry.list leaves them out)."""
    return record.state == SandboxState.RUNNING and bool(record.kernel.get("kernel_id"))


def recorded_kernel_model(record: SandboxRecord) -> dict[str, Any]:
    """The Jupyter kernel model of a live kernel another host holds: the ``kernel`` part of its
    session model from the catalog record (managed.record_model says what the record tells:
    its id, kernelspec name, last activity, busy or idle), so both APIs say the same of it."""
    return record_model(record)["kernel"]


class KernelScoped(BaseHandler):
    """Base of the handlers under ``/api/kernels/{id}``: finds the caller's kernel; serves no verb."""

    def _managed(self, kernel_id: str) -> ManagedSession:
        """The caller's kernel (KernelNotFoundError, a 404, for another tenant's or none)."""
        return self.registry.by_kernel(self.tenant, kernel_id)


class KernelHandler(KernelScoped):
    def get(self, kernel_id: str) -> None:
        self.write_json(self._managed(kernel_id).kernel_model())

    async def delete(self, kernel_id: str) -> None:
        """Shut a kernel down. An agent session's kernel is refused (409): a person debugging it
        from JupyterLab (or JupyterLab exiting) must not end the agent's sandbox."""
        managed = self._managed(kernel_id)
        if managed.origin == "session_api":
            raise ApiError(
                409,
                f"kernel {kernel_id} belongs to agent session {managed.id}; "
                f"end it with DELETE /api/sessions/{managed.id}",
                "conflict",
            )
        await self.registry.delete(self.tenant, managed.id)
        self.set_status(204)
        self.finish()


class KernelActionHandler(KernelScoped):
    """POST interrupt or restart (the same implementation as the session API's: the session service's)."""

    async def post(self, kernel_id: str, action: str) -> None:
        managed = await self.registry.for_kernel_call(self.tenant, self._managed(kernel_id).id)
        if action == "interrupt":  # 204 also when a restart under way made it a no-op (Jupyter's API)
            await self.service.interrupt(managed, KERNEL_API)
            self.set_status(204)
            self.finish()
        else:
            await self.service.restart(managed, KERNEL_API)
            self.write_json(managed.kernel_model())
