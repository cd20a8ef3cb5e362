"""The load generator's HTTP/1.1 client: a pool of keep-alive connections, each an asyncio.Protocol whose
response is parsed by httptools (llhttp, the parser uvicorn's own server side uses).

Written by hand because a load generator must cost far less than the server it measures, and the general
clients do not: aiohttp's Python per request was about the server's whole HTTP overhead around its engine.
On 2 shared cores (uvloop, medians of 1000 alternating round trips, 4 runs) a 1024-id POST to a bare uvicorn
app and its small JSON answer took 0.29-0.44 ms through aiohttp and 0.16-0.24 ms through this client, a
3-event SSE answer 0.32-0.50 against 0.23-0.31 ms; httpx was slower still (~2 ms of Python before a stream's
first token). What it does is only what the load generator needs: requests with a body, keep-alive reuse,
Content-Length, chunked (httptools decodes it) and close-delimited bodies, body bytes handed over as they
arrive (SSE), TLS through the event loop's `ssl=`.

A request is never sent twice: a connection the server closed while it sat idle is dropped before use, and
one that closes after the request was written fails that request (the server may have received it).
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from types import TracebackType
from typing import cast
from urllib.parse import SplitResult, urlsplit

import httptools

from ddtree.errors import ConfigError


class HTTPClientError(Exception):
    """The request did not get a whole response."""


class ConnectError(HTTPClientError):
    """No connection to the server (refused, unreachable, name or TLS handshake failure)."""


class ConnectionClosed(HTTPClientError):
    """The connection ended (closed, reset or unparseable) before its response did."""


class Response:
    """One response as it arrives: `status` once its head is in, body bytes by `read_chunk` or `read`."""

    __slots__ = ("status", "keep_alive", "complete", "_chunks", "_error", "_waiter", "_sized")

    def __init__(self) -> None:
        self.status = 0  # 0 until the head is parsed
        self.keep_alive = False  # the server keeps the connection (HTTP/1.1 without `Connection: close`)
        self.complete = False  # the whole message has been parsed
        self._chunks: list[bytes] = []
        self._error: HTTPClientError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sized = False  # Content-Length or Transfer-Encoding: otherwise the body ends with the connection

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, error: HTTPClientError) -> None:
        self._error = error
        self._wake()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    async def head(self) -> int:
        """Wait for the status line and headers; the status."""
        while not self.status:
            await self._wait()
        return self.status

    async def read_chunk(self) -> bytes:
        """The body bytes arrived since the last call (waiting for some), b"" once the body has ended."""
        chunks = self._chunks
        while not chunks:
            if self.complete:
                return b""
            await self._wait()
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        return data

    async def read(self) -> bytes:
        """The whole body (what is left of it)."""
        while not self.complete:
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one request in flight; its response fed through httptools."""

    def __init__(self, live: set[_Connection]) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.closed = False
        self.live = live  # the pool's connections not yet lost (closing takes a while under TLS)
        self.lost: asyncio.Future[None] | None = None  # done once the connection is lost

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass of asyncio's
        self.lost = asyncio.get_running_loop().create_future()
        self.live.add(self)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None or response.complete:
            self.close()  # bytes nobody asked for: the connection's state is unknown
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self.close()
            response._fail(ConnectionClosed(f"unparseable response from the server: {err}"))

    def eof_received(self) -> bool:
        return False  # close the transport (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.live.discard(self)
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)
        response = self.response
        if response is None or response.complete:
            return
        if response.status and not response._sized:
            response.complete = True  # a body delimited by the connection's end
            response._wake()
        else:
            why = f": {exc}" if exc else ""
            response._fail(ConnectionClosed(f"the server closed the connection before the response ended{why}"))

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            assert self.response is not None
            self.response._sized = True

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self.parser.get_status_code()
        response.keep_alive = self.parser.should_keep_alive()
        response._wake()

    def on_body(self, body: bytes) -> None:
        response = self.response
        assert response is not None
        response._chunks.append(body)
        response._wake()

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        response.complete = True
        if not response.keep_alive:
            self.close()
        response._wake()

    def send(self, data: bytes) -> Response:
        assert self.transport is not None
        self.response = response = Response()
        self.transport.write(data)
        return response

    @property
    def reusable(self) -> bool:
        response = self.response
        return (not self.closed and response is not None and response.complete and response.keep_alive
                and self.transport is not None and not self.transport.is_closing())

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


CLOSE_WAIT_S = 2.0  # how long ConnectionPool.close waits for its connections to close


def split_url(url: str) -> SplitResult:
    """`url`'s parts, checked: http or https, a host, a port in range (ConfigError naming the URL otherwise)."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises ValueError when out of range or not a number)
    except ValueError as err:
        raise ConfigError(f"base_url: {url!r}: {err}") from err
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"base_url: {url!r} must be http://host[:port][/path] or https://host[:port][/path]")
    return parts


class ConnectionPool:
    """Keep-alive connections to one server (scheme, host and port of `base_url`).

    `post` takes an idle connection (one the server has not closed) or opens one; the connection goes back
    when its response ended whole and the server keeps it, and is closed otherwise (a request cut short by
    a timeout or an error leaves it in an unknown state). No limit of its own: the caller bounds how many
    requests are in flight, so that many connections are open.
    """

    def __init__(self, base_url: str, ssl: ssl_module.SSLContext | bool = False) -> None:
        parts = split_url(base_url)
        self.host = parts.hostname or ""
        default_port = 443 if parts.scheme == "https" else 80
        self.port = parts.port or default_port
        self.ssl: ssl_module.SSLContext | None = None
        if parts.scheme == "https":
            self.ssl = ssl if isinstance(ssl, ssl_module.SSLContext) else _no_verify()
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._host_header = (host if self.port == default_port else f"{host}:{self.port}").encode("idna")
        self._idle: list[_Connection] = []
        self._live: set[_Connection] = set()
        self.connections_opened = 0

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self._live), self.host, self.port,
                                                   ssl=self.ssl, server_hostname=self.host if self.ssl else None)
        except OSError as err:  # refused, unreachable, unknown name, TLS handshake (ssl.SSLError is an OSError)
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {err}") from err
        self.connections_opened += 1
        return conn

    async def _acquire(self) -> _Connection:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if conn.reusable:
                return conn
            conn.close()  # closed by the server while it sat idle: never sent on
        return await self._connect()

    def _release(self, conn: _Connection) -> None:
        if conn.reusable:
            self._idle.append(conn)
        else:
            conn.close()

    def post(self, path: str, body: bytes, content_type: bytes = b"application/json") -> _Exchange:
        """`async with pool.post(path, body) as response:` the response once its head is in."""
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
            path.encode(), self._host_header, content_type, len(body))
        return _Exchange(self, head + body)

    async def close(self) -> None:
        """Close every connection and wait (CLOSE_WAIT_S at most, then abort) until they are gone: a TLS
        connection's close is an exchange with the server, which needs the event loop to run."""
        self._idle.clear()
        live = list(self._live)
        for conn in live:
            conn.close()
        waiting = [conn.lost for conn in live if conn.lost is not None and not conn.lost.done()]
        if waiting:
            try:
                async with asyncio.timeout(CLOSE_WAIT_S):
                    await asyncio.gather(*waiting)
            except TimeoutError:
                for conn in live:
                    if conn.transport is not None:
                        conn.transport.abort()

    async def __aenter__(self) -> ConnectionPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Exchange:
    """One request on a pooled connection, as an async context manager (the connection's return on exit)."""

    __slots__ = ("pool", "data", "conn")

    def __init__(self, pool: ConnectionPool, data: bytes) -> None:
        self.pool = pool
        self.data = data
        self.conn: _Connection | None = None

    async def __aenter__(self) -> Response:
        self.conn = conn = await self.pool._acquire()
        response = conn.send(self.data)
        try:
            await response.head()
        except BaseException:  # cancelled (a timeout) or failed before the head: the connection is not reused
            self.pool._release(conn)
            raise
        return response

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.conn is not None:
            self.pool._release(self.conn)


def _no_verify() -> ssl_module.SSLContext:
    """https with ssl=False: TLS without certificate checks (loadgen.tls_verify always gives a context)."""
    context = ssl_module.SSLContext(ssl_module.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl_module.CERT_NONE
    return context
