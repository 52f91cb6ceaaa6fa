"""GET /api/kernelspecs in a cluster lists the kernels some up host can run (issue 18, "one
endpoint"): a create through any gateway is placed cluster-wide, so the gVisor kernelspec is
offered by a gateway whose own host has no gVisor while another up host has it, and is no longer
offered once no up host runs it.

Two real ``sandkernel serve`` gateways (tests/test_forwarding.py's Host) on this engine against
one real PostgreSQL (tests/cluster_hosts.py). Both engines are this machine's, which has gVisor,
so host-a is made a host without it the way the catalog knows hosts: its registered runtimes
(written once, when it joins; placement reads the same column).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .cluster_hosts import Cluster, running_cluster
from .conftest import require_runtime
from .postgres_fixtures import postgres_server  # noqa: F401 (pytest finds it here)
from .test_cluster_membership import rows
from .test_forwarding import CLUSTER_SECRET, Host

pytestmark = pytest.mark.docker

RUNC_SPEC, GVISOR_SPEC = "sandkernel-python", "sandkernel-python-gvisor"


@pytest.fixture
async def stack(tmp_path, request) -> AsyncIterator[Cluster[Host]]:
    """host-a and host-b of one cluster, with host-a registered as a host without gVisor."""
    require_runtime("runc")
    require_runtime("runsc")
    server_url = request.getfixturevalue("postgres_server").url()
    async with running_cluster(Host, tmp_path, server_url, CLUSTER_SECRET) as cluster:
        changed = rows(cluster.catalog_url, "UPDATE hosts SET runtimes = '{runc}' WHERE host_id = 'host-a' RETURNING 1")
        assert changed == [(1,)]
        yield cluster


async def kernelspec_names(host: Host) -> list[str]:
    status, specs, _ = await host.call("GET", "/api/kernelspecs")
    assert status == 200, (status, specs)
    assert specs["default"] == RUNC_SPEC, specs  # the test gateways' default runtime: runc
    return sorted(specs["kernelspecs"])


async def test_a_host_without_gvisor_offers_it_while_an_up_host_runs_it_and_not_after(stack: Cluster[Host]):
    a, b = stack.hosts
    url = stack.catalog_url
    assert rows(url, "SELECT host_id, runtimes FROM hosts ORDER BY host_id") == [
        ("host-a", ["runc"]),
        ("host-b", ["runc", "runsc"]),
    ]

    # host-b runs gVisor: host-a lists it, and a gVisor kernel asked of host-a starts on host-b.
    assert await kernelspec_names(a) == [RUNC_SPEC, GVISOR_SPEC]
    status, spec, _ = await a.call("GET", f"/api/kernelspecs/{GVISOR_SPEC}")
    assert status == 200 and spec["name"] == GVISOR_SPEC, (status, spec)
    status, kernel, _ = await a.call("POST", "/api/kernels", {"name": GVISOR_SPEC})
    assert status == 201 and kernel["name"] == GVISOR_SPEC, (status, kernel, b.serve.output[-3000:])
    assert rows(url, "SELECT host_id FROM sandboxes WHERE kernel_id = %s", kernel["id"]) == [("host-b",)]
    status, _, _ = await a.call("DELETE", f"/api/kernels/{kernel['id']}")
    assert status == 204

    # host-b stops: no up host runs gVisor, so no gateway offers a kernel no create could start.
    assert await b.serve.term() == 0, b.serve.output[-3000:]
    assert rows(url, "SELECT status FROM hosts WHERE host_id = 'host-b'") == [("stopping",)]
    assert await kernelspec_names(a) == [RUNC_SPEC]
    status, answer, _ = await a.call("GET", f"/api/kernelspecs/{GVISOR_SPEC}")
    assert status == 404 and GVISOR_SPEC in answer["message"], (status, answer)
