"""The gateway's MCP server: the tools (tools.py), the seam that tells them whose sessions a call
may touch (resolver.py), and the streamable HTTP door at ``/mcp`` (http.py). The stdio door is
``sandkernel mcp`` (sandkernel/mcp_stdio.py). Needs the optional ``mcp`` extra."""
