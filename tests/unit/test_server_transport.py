"""The server's connection transport: a response's head leaves in one write with its first body bytes."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from ddtree.server import _HeadWithBody, http_protocol
from tests.unit.threaded_uvicorn import uvicorn_in_thread


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None


HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


def test_head_and_first_body_in_one_write_other_writes_as_they_come() -> None:
    async def main() -> None:
        raw = FakeTransport()
        t = _HeadWithBody(raw)  # type: ignore[arg-type]
        t.write(HEAD)
        assert raw.writes == [] and t.get_write_buffer_size() == len(HEAD)
        t.write(b"ok")
        t.write(b"more")
        assert raw.writes == [HEAD + b"ok", b"more"]
        await asyncio.sleep(0)  # the scheduled flush finds nothing left
        assert raw.writes == [HEAD + b"ok", b"more"]
        assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the transport's own

    asyncio.run(main())


def test_a_head_alone_goes_out_at_the_next_turn_or_on_close() -> None:
    async def main() -> None:
        raw = FakeTransport()
        t = _HeadWithBody(raw)  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await asyncio.sleep(0)
        assert raw.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
        t.write(HEAD)
        t.close()
        assert raw.writes[-1] == HEAD and raw.closed
        await asyncio.sleep(0)
        assert len(raw.writes) == 2

    asyncio.run(main())


def test_the_protocol_serves_plain_and_chunked_answers_over_one_connection() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for part in (b"a", b"b", b"c"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
                await asyncio.sleep(0.001)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    with uvicorn_in_thread(app, http=http_protocol()) as (port, _):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False) as client:
            for _ in range(3):
                assert client.get("/plain").text == "ok"
                assert client.post("/stream", content=b"x").text == "abc"
