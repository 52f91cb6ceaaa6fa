"""What each door adds to a trivial call, against the session API measured in the same run, on
one session of one in-process gateway (loopback), interleaved round by round so drift hits all:

- session API execute ``1+1`` (the baseline: POST .../execute through the Python client)
- MCP ``run_python`` ``1+1`` over streamable HTTP, the 2026-07-28 protocol (a POST per call)
- MCP ``run_python`` ``1+1`` over streamable HTTP, a legacy MCP session (``Mcp-Session-Id``)
- shell ``true`` through POST .../shell (a kernel cell that spawns ``/bin/sh``)
- deepagents ``execute("true")`` through ``SandkernelSandbox`` (the shell door plus the adapter)

Prints p50/p95 and each door's ratio to the baseline; writes bench/results/door_roundtrip.json.
Usage: python bench/door_roundtrip.py [--n 100] [--runtime runc|runsc]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import httpx2
from execute_roundtrip import interleaved, stats
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from results_dir import save_for_runtime

from sandkernel.integrations.deepagents import SandkernelSandbox
from sandkernel.local_gateway import local_gateway

BASELINE = "session API execute 1+1"


@contextlib.asynccontextmanager
async def mcp_client(url: str, token: str, mode: str):
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120)
    async with http, Client(streamable_http_client(f"{url}/mcp", http_client=http), mode=mode) as client:
        yield client


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100, help="calls per door (after 5 warm-up rounds)")
    parser.add_argument("--runtime", default="runc", choices=["runc", "runsc"])
    args = parser.parse_args()
    async with local_gateway(default_runtime=args.runtime) as client:
        session = await client.create_session()
        async with (
            mcp_client(client.url, client.token, "2026-07-28") as modern,
            mcp_client(client.url, client.token, "legacy") as legacy,
        ):
            sandbox = SandkernelSandbox(session)

            async def run_python(mcp: Client) -> None:
                result = await mcp.call_tool("run_python", {"code": "1+1", "session_id": session.id})
                assert not result.is_error, result

            async def shell() -> None:
                assert (await session.shell("true")).exit_code == 0

            async def deepagents() -> None:
                assert (await sandbox.aexecute("true")).exit_code == 0

            doors: dict[str, Callable[[], Awaitable[object]]] = {
                BASELINE: lambda: session.run("1+1", check=True),
                "MCP run_python, 2026-07-28": lambda: run_python(modern),
                "MCP run_python, legacy MCP session": lambda: run_python(legacy),
                "shell `true` (POST .../shell)": shell,
                "deepagents execute(`true`)": deepagents,
            }
            samples = await interleaved(doors, args.n)
            await session.delete()
    results = {name: stats(values) for name, values in samples.items()}
    base = results[BASELINE]["p50_ms"]
    print(f"{'door':40} {'p50 ms':>8} {'p95 ms':>8} {'x baseline':>11}   ({args.runtime}, n={args.n})")
    for name, row in results.items():
        row["ratio_to_session_api"] = row["p50_ms"] / base
        print(f"{name:40} {row['p50_ms']:8.1f} {row['p95_ms']:8.1f} {row['ratio_to_session_api']:11.2f}")
    save_for_runtime("door_roundtrip.json", args.runtime, results)


if __name__ == "__main__":
    asyncio.run(main())
