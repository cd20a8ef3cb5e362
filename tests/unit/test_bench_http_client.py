"""ddtree.bench.http_client against a real uvicorn server on a socket (and, for what uvicorn never sends, a raw one)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
import uvicorn

from ddtree.bench import loadgen
from ddtree.bench.http_client import ConnectError, ConnectionClosed, ConnectionPool
from ddtree.errors import ConfigError
from tests.unit.threaded_uvicorn import uvicorn_in_thread

BODY = bytes(range(256)) * 400  # 100 kB: several reads


class Seen:
    """What the server saw: one entry per request."""

    def __init__(self) -> None:
        self.ports: list[int] = []  # the client port of each request's connection
        self.bodies: list[bytes] = []
        self.headers: list[dict[bytes, bytes]] = []
        self.go = threading.Event()  # /pieces waits for it between its first piece and the rest

    @property
    def connections(self) -> int:
        return len(set(self.ports))


def make_app(seen: Seen) -> Callable[..., Any]:
    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        assert scope["type"] == "http"
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        seen.ports.append(scope["client"][1])
        seen.bodies.append(body)
        seen.headers.append(dict(scope["headers"]))
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        path = scope["path"]

        async def start(status: int = 200, headers: list[tuple[bytes, bytes]] | None = None) -> None:
            await send({"type": "http.response.start", "status": status, "headers": headers or []})

        if path == "/length":  # Content-Length
            await start(headers=[(b"content-length", str(len(BODY)).encode())])
            await send({"type": "http.response.body", "body": BODY})
        elif path == "/chunked":  # no Content-Length: uvicorn sends it chunked, one chunk a send
            await start()
            for i in range(0, len(BODY), 7001):
                await send({"type": "http.response.body", "body": BODY[i:i + 7001], "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        elif path == "/pieces":  # the first piece, then (once the client has it) the rest
            await start()
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await asyncio.get_running_loop().run_in_executor(None, seen.go.wait, 10)
            await send({"type": "http.response.body", "body": b"rest", "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        elif path == "/echo":
            await start(headers=[(b"content-length", str(len(body)).encode())])
            await send({"type": "http.response.body", "body": body})
        elif path == "/close":  # the answer, then the connection closed (uvicorn honours the app's header)
            await start(headers=[(b"connection", b"close"), (b"content-length", b"2")])
            await send({"type": "http.response.body", "body": b"ok"})
        elif path == "/status":
            text = b'{"error": "' + b"x" * 900 + b'"}'
            await start(int(query["code"]), [(b"content-length", str(len(text)).encode())])
            await send({"type": "http.response.body", "body": text})
        elif path == "/hang":
            await asyncio.sleep(30)
        elif path == "/generate":  # a plain SGLang answer
            answer = b'{"text": "", "output_ids": [4, 5], "meta_info": {"completion_tokens": 2}}'
            await start(headers=[(b"content-length", str(len(answer)).encode())])
            await send({"type": "http.response.body", "body": answer})
        else:
            await start(404, [(b"content-length", b"0")])
            await send({"type": "http.response.body", "body": b""})

    return app


@contextmanager
def serve(**config: Any) -> Iterator[tuple[str, Seen, uvicorn.Server]]:
    """uvicorn (httptools, asyncio's loop) in a thread on a free port; the URL, what it saw, the server."""
    seen = Seen()
    scheme = "https" if "ssl_certfile" in config else "http"
    with uvicorn_in_thread(make_app(seen), ws="none", http="httptools", timeout_graceful_shutdown=1,
                           **config) as (port, server):
        try:
            yield f"{scheme}://127.0.0.1:{port}", seen, server
        finally:
            seen.go.set()  # before the server stops: held responses end


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Seen]]:
    with serve() as (url, seen, _):
        yield url, seen


@pytest.fixture
def fresh(server: tuple[str, Seen]) -> tuple[str, Seen]:
    url, seen = server
    seen.ports.clear()
    seen.bodies.clear()
    seen.headers.clear()
    seen.go.clear()
    return url, seen


def run(coro: Any) -> Any:
    return loadgen.run_client(coro)


async def post(pool: ConnectionPool, path: str, body: bytes = b"{}") -> tuple[int, bytes]:
    async with pool.post(path, body) as response:
        return response.status, await response.read()


def test_sequential_requests_reuse_one_connection_and_concurrent_ones_one_each(fresh: tuple[str, Seen]) -> None:
    url, seen = fresh

    async def main() -> int:
        async with ConnectionPool(url) as pool:
            for _ in range(6):
                assert await post(pool, "/length") == (200, BODY)
            assert seen.connections == 1 and len(seen.ports) == 6, seen.ports
            seen.ports.clear()

            async def worker() -> None:
                for _ in range(4):
                    assert await post(pool, "/echo", b"abc") == (200, b"abc")

            await asyncio.gather(*(worker() for _ in range(3)))
            return pool.connections_opened

    opened = run(main())
    assert len(seen.ports) == 12 and seen.connections == 3, seen.ports  # the first one is among the three
    assert opened == 3


def test_content_length_chunked_and_the_request_as_sent(fresh: tuple[str, Seen]) -> None:
    url, seen = fresh
    sent = b'{"input_ids": [1, 2, 3]}' * 1000

    async def main() -> list[tuple[int, bytes]]:
        async with ConnectionPool(url) as pool:
            return [await post(pool, "/length"), await post(pool, "/chunked"), await post(pool, "/echo", sent)]

    (s1, b1), (s2, b2), (s3, b3) = run(main())
    assert (s1, s2, s3) == (200, 200, 200)
    assert b1 == BODY and b2 == BODY and b3 == sent
    assert seen.bodies[2] == sent
    headers = seen.headers[2]
    assert headers[b"content-type"] == b"application/json" and headers[b"content-length"] == str(len(sent)).encode()
    assert headers[b"host"] == url.removeprefix("http://").encode()


def test_body_bytes_are_handed_over_as_they_arrive(fresh: tuple[str, Seen]) -> None:
    """The first piece reaches the caller while the server still holds the rest back (an SSE stream's chunks)."""
    url, seen = fresh

    async def main() -> list[bytes]:
        async with ConnectionPool(url) as pool, pool.post("/pieces", b"") as response:
            async with asyncio.timeout(5):
                first = await response.read_chunk()
            seen.go.set()
            rest = [first]
            while data := await response.read_chunk():
                rest.append(data)
            return rest

    pieces = run(main())
    assert pieces[0] == b"first" and b"".join(pieces) == b"firstrest"


def test_a_server_that_closes_after_each_response_gets_a_fresh_connection_each_time(fresh: tuple[str, Seen]) -> None:
    url, seen = fresh

    async def main() -> int:
        async with ConnectionPool(url) as pool:
            for _ in range(3):
                assert await post(pool, "/close") == (200, b"ok")
            assert await post(pool, "/length") == (200, BODY)
            return pool.connections_opened

    assert run(main()) == 4
    assert len(seen.ports) == 4 and seen.connections == 4


def test_an_idle_connection_the_server_closed_is_replaced_not_sent_on() -> None:
    """uvicorn closes a keep-alive connection idle for timeout_keep_alive; the next request connects anew and
    reaches the server once."""
    with serve(timeout_keep_alive=0.1) as (url, seen, _):

        async def main() -> int:
            async with ConnectionPool(url) as pool:
                assert await post(pool, "/echo", b"one") == (200, b"one")
                await asyncio.sleep(0.6)  # the server closes the idle connection meanwhile
                assert await post(pool, "/echo", b"two") == (200, b"two")
                return pool.connections_opened

        assert run(main()) == 2
        assert seen.bodies == [b"one", b"two"] and seen.connections == 2


def test_an_error_status_comes_with_its_body_and_keeps_the_connection(fresh: tuple[str, Seen]) -> None:
    url, seen = fresh

    async def main() -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        async with ConnectionPool(url) as pool:
            return await post(pool, "/status?code=503"), await post(pool, "/length")

    (status, body), after = run(main())
    assert status == 503 and body.startswith(b'{"error": "xxx') and len(body) == 913
    assert after == (200, BODY) and seen.connections == 1


def test_a_request_cut_by_a_timeout_closes_its_connection(fresh: tuple[str, Seen]) -> None:
    url, seen = fresh

    async def main() -> tuple[float, int]:
        async with ConnectionPool(url) as pool:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await post(pool, "/hang")
            waited = time.monotonic() - t0
            assert await post(pool, "/length") == (200, BODY)  # not on the hung connection
            return waited, pool.connections_opened

    waited, opened = run(main())
    # uvloop keeps its loop time in whole milliseconds, so by time.monotonic the 0.3 s timer may fire a
    # little early; the bound only says the request hung until the timeout cut it
    assert 0.25 <= waited < 5 and opened == 2 and seen.connections == 2


def test_a_refused_connection_is_a_connect_error() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now

    async def main() -> None:
        async with ConnectionPool(f"http://127.0.0.1:{port}") as pool:
            await post(pool, "/length")

    with pytest.raises(ConnectError, match=f"cannot connect to 127.0.0.1:{port}"):
        run(main())


@pytest.mark.parametrize("url", ["ftp://host/", "http://", "127.0.0.1:30000", "http://host:99999"])
def test_a_bad_base_url_names_it(url: str) -> None:
    with pytest.raises(ConfigError, match="base_url"):
        ConnectionPool(url)
    with pytest.raises(ConfigError, match="base_url"):
        loadgen.run_load(url, [[1]], concurrency=1, max_new_tokens=1)


# -- a raw server: responses uvicorn never writes ------------------------------------------------------------


@contextmanager
def raw_server(respond: Callable[[socket.socket], None]) -> Iterator[tuple[str, list[bytes]]]:
    """A thread accepting connections; per connection it reads one request's head and body, records it and
    calls respond(conn) (which writes what it likes and may close); the URL and the requests read."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    requests: list[bytes] = []

    def read_request(conn: socket.socket) -> bytes | None:
        data = b""
        while b"\r\n\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                return None
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(65536)
        return head + b"\r\n\r\n" + body

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                while (request := read_request(conn)) is not None:
                    requests.append(request)
                    respond(conn)
                    if conn.fileno() < 0:
                        break

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", requests
    finally:
        listener.close()


def test_a_response_written_byte_by_byte_is_parsed_whole() -> None:
    """Every boundary a read can end on: inside the status line, a header, a chunk's size line, its CRLF."""
    payload = b"data: {\"a\": 1}\n\ndata: [DONE]\n\n"
    wire = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(payload[i:i + 5]), payload[i:i + 5]) for i in range(0, len(payload), 5))
            + b"0\r\n\r\n")

    def respond(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(wire)):
            conn.sendall(wire[i:i + 1])
            time.sleep(0.0005)

    with raw_server(respond) as (url, requests):

        async def main() -> tuple[int, bytes, int]:
            async with ConnectionPool(url) as pool:
                status, body = await post(pool, "/x")
                assert await post(pool, "/y") == (200, payload)  # the connection was left clean
                return status, body, pool.connections_opened

        assert run(main()) == (200, payload, 1)
        assert len(requests) == 2


def test_a_body_delimited_by_the_connections_end() -> None:
    def respond(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")
        conn.shutdown(socket.SHUT_WR)
        conn.close()

    with raw_server(respond) as (url, _):

        async def main() -> tuple[int, bytes]:
            async with ConnectionPool(url) as pool:
                return await post(pool, "/x")

        assert run(main()) == (200, b"all of it")


@pytest.mark.parametrize("reply", [b"", b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf", b"HTTP/1.1 2OO no\r\n\r\n"],
                         ids=["no-answer", "body-cut", "garbage"])
def test_a_connection_that_ends_before_its_response_fails_the_request_once(reply: bytes) -> None:
    """Closed after the request was read (with nothing, half an answer, or bytes that are not HTTP): the
    request fails and is not sent again (the server may have acted on it); the load generator records it."""

    def respond(conn: socket.socket) -> None:
        conn.sendall(reply)
        time.sleep(0.05)
        conn.close()

    with raw_server(respond) as (url, requests):

        async def main() -> None:
            async with ConnectionPool(url) as pool:
                await post(pool, "/x")

        with pytest.raises(ConnectionClosed):
            run(main())
        assert len(requests) == 1
        for stream in (True, False):
            (record,) = loadgen.run_load(url, [[1, 2]], concurrency=1, max_new_tokens=2, timeout_s=10, stream=stream)
            assert not record.ok and record.error is not None and record.error.startswith("connection error: "), record
        assert len(requests) == 3


# -- TLS ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl's command line)."""
    if shutil.which("openssl") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("openssl (the command) is needed for the TLS test")
        pytest.skip("no openssl command")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def test_https_through_the_loops_tls_with_certificate_checks(certificate: tuple[Path, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = certificate
    with serve(ssl_certfile=str(cert), ssl_keyfile=str(key)) as (url, seen, _):
        assert url.startswith("https://")
        trusted = ssl.create_default_context(cafile=str(cert))

        async def main(context: ssl.SSLContext) -> tuple[int, bytes, int]:
            async with ConnectionPool(url, ssl=context) as pool:
                status, body = await post(pool, "/echo", b"secret")
                assert await post(pool, "/length") == (200, BODY)
                return status, body, pool.connections_opened

        assert run(main(trusted)) == (200, b"secret", 1)
        assert seen.connections == 1
        with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            run(main(ssl.create_default_context()))  # the system's CAs do not know this certificate

        # the load generator: https gets loadgen.tls_verify's context (the system's CAs), then one that knows it
        (refused,) = loadgen.run_load(url, [[1]], concurrency=1, max_new_tokens=2, timeout_s=10, stream=False)
        assert not refused.ok and refused.error is not None and "CERTIFICATE_VERIFY_FAILED" in refused.error
        assert refused.error.startswith("connection error: ")
        monkeypatch.setattr(loadgen, "_default_tls", lambda: trusted)
        (answered,) = loadgen.run_load(url, [[1]], concurrency=1, max_new_tokens=2, timeout_s=10, stream=False)
        assert answered.ok and answered.output_ids == [4, 5], answered.error
