"""The bench client resends once when a server drops an idle keep-alive connection (llama-server
does after a few requests) instead of reporting a failed request."""

from __future__ import annotations

import asyncio

from hasten.bench.httpclient import HttpClient, HttpError

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def serve_one_request_per_connection(counter: list[int]):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            counter[0] += 1
            if served == 1:  # second request on this connection: drop it unanswered
                writer.close()
                return
            writer.write(RESPONSE)
            await writer.drain()
            served += 1

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_stale_keepalive_connection_is_retried_once():
    counter = [0]
    server = await serve_one_request_per_connection(counter)
    port = server.sockets[0].getsockname()[1]
    client = HttpClient(f"http://127.0.0.1:{port}")
    try:
        for _ in range(3):
            resp = await client.post("/v1/completions", b"{}", timeout=5)
            assert resp.status == 200
        assert counter[0] == 5  # 3 answered + 2 dropped on reused connections and resent
    finally:
        client.close()
        server.close()
        await server.wait_closed()


async def test_fresh_connection_closed_is_still_an_error():
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = HttpClient(f"http://127.0.0.1:{port}")
    try:
        try:
            await client.post("/v1/completions", b"{}", timeout=5)
        except HttpError as exc:
            assert exc.kind == "closed_before_response"
        else:
            raise AssertionError("expected an error")
    finally:
        client.close()
        server.close()
        await server.wait_closed()
