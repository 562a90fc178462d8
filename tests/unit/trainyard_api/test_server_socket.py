"""The API's listening socket: connections accepted on it have Nagle off (TCP_NODELAY), so a response
written as headers then body is not held back until the client's delayed ACK (~40 ms a request)."""

from __future__ import annotations

import asyncio
import socket

from trainyard_api.server import bind_socket


async def test_accepted_connections_have_nagle_off() -> None:
    sock = bind_socket("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    seen: list[int] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accepted, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        while not seen:
            await asyncio.sleep(0.01)
        writer.close()
    assert seen[0] != 0
