"""Which optional install brings which module, so a command run without it says what to install.

``pip install sandkernel`` is the client alone (the Python client and its one dependency,
tornado): an agent's host that only calls a gateway gets no Docker SDK, kernel or model SDK.
The server, the Claude agent, MCP, the cluster and deepagents are extras (pyproject.toml);
:data:`EXTRA_FOR_MODULE` maps each top-level module they bring to the extra that brings it.
"""

from __future__ import annotations

EXTRA_FOR_MODULE = {
    "docker": "server",
    "requests": "server",
    "jupyter_client": "server",
    "ipykernel": "server",
    "zmq": "server",
    "nbformat": "server",
    "traitlets": "server",
    "prometheus_client": "server",
    "PIL": "agent",
    "anthropic": "agent",
    "mcp": "mcp",
    "psycopg": "cluster",
    "psycopg_pool": "cluster",
    "deepagents": "deepagents",
    "langchain_core": "deepagents",
    "langchain_anthropic": "deepagents",
}


def missing_extra(err: ModuleNotFoundError) -> str | None:
    """The extra that brings the module ``err`` could not import, or None when it is not one of
    theirs (a real bug, which must not be dressed up as an install hint)."""
    top = (err.name or "").split(".")[0]
    return EXTRA_FOR_MODULE.get(top)


def install_hint(command: str, extra: str) -> str:
    """The sentence a command prints when its extra is not installed."""
    return f"`sandkernel {command}` needs the {extra} packages, not in this install: pip install 'sandkernel[{extra}]'"
