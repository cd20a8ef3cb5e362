"""uvicorn serving an ASGI app from a thread of the test process, on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


@contextmanager
def uvicorn_in_thread(app: Any, **config: Any) -> Iterator[tuple[int, uvicorn.Server]]:
    """The port and the server once it has started (10 s at most); stopped and joined on exit.
    `config`: uvicorn.Config's own keywords (log_level and lifespan default to "error" and "off")."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, **({"log_level": "error", "lifespan": "off"} | config)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start in 10 s"
            time.sleep(0.02)
        yield port, server
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
