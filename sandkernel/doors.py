"""The doors an execution can come through, as its transcript cell records them (``source``).

The gateway sets the door of what it serves itself (the session API, the Jupyter websocket, its
MCP server). A client library may say which integration it is with a ``source`` field, but only
one of :data:`CLIENT_DOORS`: the label is a tenant's claim, shown in the transcript, never a
permission, and no client can pass itself off as the gateway's own MCP server.
"""

from __future__ import annotations

SESSION_API = "session_api"
MCP = "mcp"
KERNEL_API = "kernel_api"  # Jupyter's REST kernel API (interrupt, restart)
WEBSOCKET = "websocket"  # the kernel API's websocket: a Jupyter client's own execute_request
DEEPAGENTS = "deepagents"
CLIENT_DOORS = (SESSION_API, DEEPAGENTS, "langchain", "agent")
