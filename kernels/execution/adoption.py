"""Re-adopting a sandbox a previous gateway process started: the record, the checks, the leftovers.

A sandbox outlives the process that made it: its container keeps running, its runtime dir keeps
the kernel's ipc sockets, its workspace disk keeps the files. What the next process needs to talk
to it again is written down as the session's *durable state* (:func:`durable_state`) and kept in
the session catalog (kernels/durable/store.py), including the HMAC key of its messages.

Re-adoption treats the sandbox with the care of a first start, because everything under the
container was writable by tenant code: the container must still carry the labels, image and
runtime the record names (anyone with Docker access can make a look-alike), the runtime dir must
be literally one of ours and hold exactly the five sockets and the two files the host wrote
(checked without following anything), and only then does a kernel manager connect. A sandbox
whose container died meanwhile is *lost* (:class:`SandboxLostError`, with how it died); one that
is not what the record says is *refused* (:class:`AdoptionRefusedError`) and left alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import docker.errors
from jupyter_client import AsyncKernelManager
from jupyter_client.provisioning import KernelProvisionerFactory

from sandkernel.errors import AdoptionRefusedError, SandboxLostError, SandkernelError, TransportError
from sandkernel.kernels.egress.proxy import EgressProxy
from sandkernel.kernels.execution.deaths import LATE_OOM_EVENT_SECONDS
from sandkernel.kernels.execution.transport import new_kernel_manager
from sandkernel.kernels.model.profiles import Profile, resolve_profile
from sandkernel.kernels.sandbox.container import (
    SUPERVISOR_ENTRYPOINT,
    ContainerSpec,
    SandboxContainer,
    killed_for_memory,
    parse_engine_time,
)
from sandkernel.kernels.sandbox.cpu_groups import group_of
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, default_engine, translate_api_error
from sandkernel.kernels.sandbox.exec_stream import SIGKILL_EXIT
from sandkernel.kernels.sandbox.labels import (
    KERNEL_LABEL,
    RUNTIME_DIR_LABEL,
    SESSION_LABEL,
    own_runtime_dir,
    owner_label,
)
from sandkernel.kernels.sandbox.provisioner import DockerProvisioner
from sandkernel.kernels.sandbox.runtime_dir import RuntimeDir, default_base_dir, remove_runtime_dir
from sandkernel.kernels.sandbox.uids import UID_LABEL, UidAllocator
from sandkernel.kernels.sandbox.workspace_disk import WorkspaceDisk

log = logging.getLogger(__name__)

# The layout of a durable state; a newer gateway migrates older ones in the catalog.
STATE_VERSION = 1
SESSION_ID = re.compile(r"[0-9a-f]{8,64}")


# -- the record ---------------------------------------------------------------------------


def profile_record(profile: Profile) -> dict[str, Any]:
    """A profile as JSON that :func:`profile_from_record` turns back into the same profile."""
    data = profile.to_dict()
    data["network"] = profile.network.to_config() if profile.network else None
    return data


def profile_from_record(data: dict[str, Any]) -> Profile:
    """The recorded profile, every setting checked again as when it was first chosen."""
    settings = dict(data)
    return resolve_profile(Profile(name=str(settings.pop("name", "default"))), settings)


def durable_state(provisioner: DockerProvisioner, km: AsyncKernelManager) -> dict[str, Any]:
    """Everything a later process needs to re-adopt this sandbox (JSON; holds the HMAC key)."""
    container = provisioner.container
    if container is None or provisioner.runtime_dir is None or provisioner.profile is None:
        raise TransportError(f"session {provisioner.session_id} has no running sandbox to record")
    info = dict(km.get_connection_info())
    if isinstance(info.get("key"), bytes):
        info["key"] = info["key"].decode()
    workspace = getattr(provisioner, "workspace_disk", None)
    return {
        "version": STATE_VERSION,
        "profile": profile_record(provisioner.profile),
        "kernel_name": km.kernel_name,
        "kernel_id": str(km.kernel_id),
        "container_id": container.id,
        "exec_id": container.exec_id,
        "host_process": list(container.host_process) if container.host_process else None,
        "uid": provisioner.uid,
        "runtime_dir": str(provisioner.runtime_dir.path),
        "connection_info": info,
        "image_id": provisioner.image_id,
        "workspace_disk": workspace.to_dict() if workspace is not None else None,
    }


def _field(state: dict[str, Any], name: str, kind: type) -> Any:
    value = state.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise AdoptionRefusedError(f"the catalog's record has no valid {name!r}; the sandbox is left alone")
    return value


def _checked_runtime_dir(label: str) -> Path:
    """The recorded runtime dir, if it is one of ours (the reaper's rule, :func:`own_runtime_dir`:
    literally ``<base>/<12 hex>``, real directories of this user's, never followed); a well-formed
    one that is gone means the sandbox is lost, anything else is refused."""
    path = own_runtime_dir(label)
    if path is not None:
        return path
    if Path(label).parent == default_base_dir() and not os.path.lexists(label):
        raise SandboxLostError(f"its runtime dir {label} is gone")
    raise AdoptionRefusedError(f"recorded runtime dir {label!r} is not one of this host's runtime dirs")


# -- checks -------------------------------------------------------------------------------


async def _inspect(container_id: str) -> dict[str, Any]:
    engine = default_engine()
    try:
        return await engine.run(engine.client.api.inspect_container, container_id)
    except docker.errors.NotFound:
        raise SandboxLostError("its container was removed while no gateway was attached") from None
    except docker.errors.APIError as err:
        raise translate_api_error(err, "cannot inspect a recorded sandbox") from err


async def lost_reason(engine: DockerEngine, attrs: dict[str, Any]) -> str:
    """How a container that no longer runs ended, in words for the session's listing. A stop
    the engine recorded moments ago may still have its OOM event to come (see deaths.py)."""
    state = attrs.get("State") or {}
    try:
        since_stop = time.time() - parse_engine_time(str(state.get("FinishedAt") or ""))
    except ValueError:
        since_stop = LATE_OOM_EVENT_SECONDS
    grace = max(0.0, LATE_OOM_EVENT_SECONDS - since_stop)
    if await killed_for_memory(engine, str(attrs.get("Id") or ""), state, grace):
        return "its container was killed for memory (OOM) while no gateway was attached"
    code = state.get("ExitCode")
    if code == SIGKILL_EXIT:  # the engine's record of an OOM can be lost (see oom_event_logged)
        return (
            f"its container was killed (SIGKILL, exit code {code}: what its memory limit's OOM killer sends, "
            "unless it was killed from outside) while no gateway was attached"
        )
    return f"its container stopped (exit code {code}) while no gateway was attached"


def _check_container(attrs: dict[str, Any], session_id: str, state: dict[str, Any], profile: Profile) -> None:
    """Refuse a container that is not the one recorded."""
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    expected = {
        SESSION_LABEL: session_id,
        KERNEL_LABEL: state["kernel_id"],
        RUNTIME_DIR_LABEL: state["runtime_dir"],
        UID_LABEL: str(state["uid"]),
    }
    wrong = sorted(name for name, value in expected.items() if labels.get(name) != value)
    if wrong:
        raise AdoptionRefusedError(f"container {attrs.get('Id', '?')[:12]} carries other labels ({', '.join(wrong)})")
    if attrs.get("Image") != state["image_id"]:
        raise AdoptionRefusedError("the container runs another image than the one recorded")
    runtime = (attrs.get("HostConfig") or {}).get("Runtime")
    if runtime != profile.runtime.value:
        raise AdoptionRefusedError(f"the container runs under {runtime!r}, not the recorded {profile.runtime.value!r}")


# -- adoption -----------------------------------------------------------------------------


async def reattach(session_id: str, state: dict[str, Any]) -> AsyncKernelManager:
    """A kernel manager connected to the recorded sandbox, after every check (see the module
    docstring). Raises SandboxLostError or AdoptionRefusedError; touches nothing on refusal."""
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise AdoptionRefusedError(f"recorded session id {session_id!r} is not one sandkernel makes")
    if state.get("version") != STATE_VERSION:
        raise AdoptionRefusedError(
            f"the record's layout is version {state.get('version')!r}; this gateway reads version {STATE_VERSION}"
        )
    for name, kind in (
        ("kernel_id", str),
        ("container_id", str),
        ("runtime_dir", str),
        ("uid", int),
        ("connection_info", dict),
        ("image_id", str),
        ("kernel_name", str),
        ("profile", dict),
    ):
        _field(state, name, kind)
    profile = profile_from_record(state["profile"])
    attrs = await _inspect(state["container_id"])
    _check_container(attrs, session_id, state, profile)
    if not (attrs.get("State") or {}).get("Running"):
        raise SandboxLostError(await lost_reason(default_engine(), attrs))
    rundir_path = _checked_runtime_dir(state["runtime_dir"])
    info = dict(state["connection_info"])
    try:
        runtime_dir = await asyncio.to_thread(RuntimeDir.reattach, rundir_path, info)
    except TransportError as err:
        raise AdoptionRefusedError(f"its runtime dir is not as the host left it: {err}") from err
    workspace = await _reopen_workspace(state)

    km = new_kernel_manager(state["kernel_name"])
    km.kernel_id = state["kernel_id"]
    km.load_connection_info(info)
    provisioner = KernelProvisionerFactory.instance().create_provisioner_instance(
        km.kernel_id, km.kernel_spec, parent=km
    )
    if not isinstance(provisioner, DockerProvisioner):
        raise AdoptionRefusedError(f"kernel {state['kernel_name']!r} is not a sandkernel kernel")
    engine = default_engine()
    # Savable: its PID 1 is the kernel supervisor, as Docker recorded the entrypoint (the
    # sandbox cannot change that record).
    savable = SUPERVISOR_ENTRYPOINT in ((attrs.get("Config") or {}).get("Entrypoint") or [])
    spec = ContainerSpec(
        profile, session_id, km.kernel_id, runtime_dir, state["uid"], _egress_dir(profile, runtime_dir), savable=savable
    )
    container = SandboxContainer(engine, state["container_id"], spec)
    container.exec_id = state.get("exec_id") if isinstance(state.get("exec_id"), str) else None
    container.recall_host_process(state.get("host_process"))
    provisioner.profile = profile
    provisioner.session_id = session_id
    provisioner.image_id = state["image_id"]
    provisioner.runtime_dir = runtime_dir
    provisioner.uid = state["uid"]
    provisioner.savable = savable
    # Where Docker put it (not the sandbox's to change): a replacement container joins it.
    provisioner.cpu_group = group_of((attrs.get("HostConfig") or {}).get("CgroupParent"))
    provisioner.container = container
    provisioner.connection_info = km.get_connection_info()
    if workspace is not None:
        provisioner.workspace_disk = workspace
    await asyncio.to_thread(UidAllocator(engine).claim, state["uid"])
    if profile.network is not None:
        provisioner.egress = EgressProxy(profile.network, session_id, runtime_dir.egress_dir)
        await provisioner.egress.start()
    km.provisioner = provisioner
    # What KernelManager.start_kernel would have kept: a restart relaunches with these.
    km._launch_args = {
        "sandkernel_profile": profile,
        "sandkernel_session_id": session_id,
        "sandkernel_cpu_group": provisioner.cpu_group,
    }
    km._attempted_start = True
    km._connect_control_socket()
    return km


def _egress_dir(profile: Profile, runtime_dir: RuntimeDir) -> Path | None:
    return runtime_dir.egress_dir if profile.network is not None else None


async def _reopen_workspace(state: dict[str, Any]) -> WorkspaceDisk | None:
    """The session's workspace disk, mounted again if the host rebooted (None: a tmpfs one)."""
    record = state.get("workspace_disk")
    if record is None:
        return None
    disk = WorkspaceDisk.from_dict(record)  # AdoptionRefusedError for a record naming elsewhere
    try:
        await asyncio.to_thread(disk.ensure_mounted)
    except (SandboxLostError, AdoptionRefusedError):
        raise
    except (OSError, SandkernelError) as err:
        raise SandboxLostError(f"its workspace disk cannot be mounted ({err})") from err
    await asyncio.to_thread(disk.claim, owner_label())
    return disk


async def discard(session_id: str, state: dict[str, Any]) -> None:
    """Remove what is left of a lost (or deleted, unadoptable) sandbox: its container if it still
    exists and is the recorded one, its runtime dir, its workspace disk, its uid's reservation.
    Nothing that the record names but that fails its checks is touched."""
    engine = default_engine()
    container_id = state.get("container_id")
    if isinstance(container_id, str):
        try:
            attrs = await engine.run(engine.client.api.inspect_container, container_id)
        except docker.errors.NotFound:
            attrs = None
        except docker.errors.APIError as err:
            raise translate_api_error(err, "cannot inspect a recorded sandbox") from err
        labels = ((attrs or {}).get("Config") or {}).get("Labels") or {}
        if attrs is not None and labels.get(SESSION_LABEL) == session_id:
            await engine.run(lambda: engine.client.api.remove_container(container_id, force=True))
    path = own_runtime_dir(state["runtime_dir"]) if isinstance(state.get("runtime_dir"), str) else None
    if path is not None:
        await asyncio.to_thread(remove_runtime_dir, path)
    if state.get("workspace_disk") is not None:
        try:
            await asyncio.to_thread(WorkspaceDisk.from_dict(state["workspace_disk"]).remove)
        except (OSError, ValueError, SandkernelError) as err:
            log.warning("cannot remove a lost session's workspace disk: %s", err, extra={"session": session_id})
    if isinstance(state.get("uid"), int):
        await asyncio.to_thread(UidAllocator(engine).release, state["uid"])
