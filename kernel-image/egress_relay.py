"""Inside the sandbox: expose the session's egress proxy (a host unix socket, mounted read-only)
as http://127.0.0.1:3128 for HTTP_PROXY/HTTPS_PROXY, since Python tools speak TCP to proxies.

It only moves bytes; every decision is made by the proxy on the host, so code that kills or
replaces this relay gains nothing. Started by launch-kernel when SANDKERNEL_EGRESS_SOCKET is set.
"""

import asyncio
import os

PORT = 3128


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other direction may still be answering
    except OSError:
        pass


async def serve(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
    try:
        up_reader, up_writer = await asyncio.open_unix_connection(os.environ["SANDKERNEL_EGRESS_SOCKET"])
    except OSError:
        client_writer.write(b"HTTP/1.1 502 sandkernel egress proxy unavailable\r\nConnection: close\r\n\r\n")
        client_writer.close()
        return
    try:
        await asyncio.gather(pipe(client_reader, up_writer), pipe(up_reader, client_writer))
    finally:
        up_writer.close()
        client_writer.close()


async def main() -> None:
    server = await asyncio.start_server(serve, "127.0.0.1", PORT)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
