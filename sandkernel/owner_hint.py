"""The header a gateway of a cluster names itself in, so a client can call a session's host
directly (one place for the name: the gateway sets it, the Python client reads it).

In a cluster any gateway answers for any session by forwarding the request to the host that
holds it; the hop costs about 1.5 ms per call on this project's machine (bench/README.md,
``cluster.py``). Every answer a cluster gateway gives carries ``X-Sandkernel-Host: <its
advertise URL>``; a forwarded answer carries the owner's (the forwarder passes the owner's header
on, never its own). The Python client (``AsyncSandkernel``, unless ``direct_to_owner=False``)
then sends a session's later calls straight there, over its endpoint's scheme only, and through
its own endpoint for a while when the host cannot be reached (agent/client.py). The header says
where, never who: the tenant's token still authenticates every call.
"""

from __future__ import annotations

HOST_HEADER = "X-Sandkernel-Host"
