"""The Jupyter-compatible kernel API: what jupyter_server's GatewayClient (JupyterLab with
``--gateway-url``) and other standard clients call. Every kernel is a sandkernel session."""

from __future__ import annotations

from typing import Any

from sandkernel import __version__
from sandkernel.doors import KERNEL_API
from sandkernel.gateway.base import ApiError, BaseHandler
from sandkernel.gateway.registry import ManagedSession
from sandkernel.kernels.lifecycle.profiles import Runtime
from sandkernel.kernels.sandbox.kernelspec import KERNEL_NAMES, kernel_json, kernel_name_for


def kernelspec_model(name: str) -> dict[str, Any]:
    spec = kernel_json(name)
    spec.pop("env", None)
    return {"name": name, "spec": spec, "resources": {}}


class ApiRootHandler(BaseHandler):
    def get(self) -> None:
        self.write_json({"version": "2.0.0", "sandkernel": __version__})


def offered_kernel_names(handler: BaseHandler) -> list[str]:
    """The kernelspecs a tenant may start: those whose runtime the default profile offers."""
    offered = handler.registry.catalog.ceilings["default"].runtimes
    return [name for name, runtime in KERNEL_NAMES.items() if Runtime(runtime) in offered]


def default_kernel_name(handler: BaseHandler) -> str:
    """The kernelspec of the default profile's runtime (gVisor where the operator chose it)."""
    return kernel_name_for(handler.registry.catalog.profile("default").runtime)


class KernelSpecsHandler(BaseHandler):
    def get(self) -> None:
        names = offered_kernel_names(self)
        self.write_json({"default": default_kernel_name(self), "kernelspecs": {n: kernelspec_model(n) for n in names}})


class KernelSpecHandler(BaseHandler):
    def get(self, name: str) -> None:
        offered = offered_kernel_names(self)
        if name not in offered:
            raise ApiError(404, f"no kernelspec {name[:64]!r}; available: {offered}")
        self.write_json(kernelspec_model(name))


class KernelsHandler(BaseHandler):
    def get(self) -> None:
        self.write_json([s.kernel_model() for s in self.registry.list(self.tenant)])

    async def post(self) -> None:
        body = self.json_body()
        name = body.get("name") or default_kernel_name(self)
        if not isinstance(name, str) or name not in KERNEL_NAMES:
            shown = name[:64] if isinstance(name, str) else name
            raise ApiError(400, f"unknown kernel name {shown!r}; use one of {sorted(KERNEL_NAMES)}", "unknown_kernel")
        limits = {"runtime": KERNEL_NAMES[name]}
        managed = await self.registry.create(
            self.tenant, limits=limits, metadata={"name": "kernel"}, origin="kernel_api"
        )
        self.set_header("Location", f"/api/kernels/{managed.session.kernel_id}")
        self.write_json(managed.kernel_model(), status=201)


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
    """POST interrupt or restart (the same implementation as the session API's: ManagedSession's)."""

    async def post(self, kernel_id: str, action: str) -> None:
        managed = self._managed(kernel_id)
        if action == "interrupt":
            await managed.interrupt(KERNEL_API)
            self.set_status(204)
            self.finish()
        else:
            await managed.restart(KERNEL_API)
            self.write_json(managed.kernel_model())
