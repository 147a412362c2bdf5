"""A Service's ClusterIP in a rehearsal: listen on each Service port and forward every
connection to the selected pod's address and target port, as kube-proxy does for a Service
whose port differs from the pod's. Standalone (the standard library alone), so it runs in the
rehearsal image's Python, in a container that holds the Service's DNS names:

    python forwarder.py PORT=ADDRESS:TARGET [PORT=ADDRESS:TARGET ...]

A pod that is not listening yet closes the client's connection at once, as a Service with no
ready endpoint does (the client retries; the router's worker checks do).
"""

from __future__ import annotations

import asyncio
import sys

CHUNK = 1 << 16


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction until its end, then half-close: an HTTP client that has sent its
    request still gets the answer."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        pass


def handler(address: str, port: int):  # type: ignore[no-untyped-def]
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(address, port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, upstream_writer), pipe(upstream_reader, client_writer))
        upstream_writer.close()
        client_writer.close()

    return handle


async def main(rules: list[str]) -> None:
    servers = []
    for rule in rules:
        listen, _, target = rule.partition("=")
        address, _, port = target.rpartition(":")
        servers.append(await asyncio.start_server(handler(address, int(port)), "0.0.0.0", int(listen)))
    print(f"forwarding {' '.join(rules)}", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
