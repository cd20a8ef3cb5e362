"""Polling instead of sleeping while requests come and go (SGLang's scheduler polls too; `--sleep-on-idle`
turns it off there and here).

A served request crosses processes six times (client -> HTTP, HTTP -> engine, and each of its first and last
tokens engine -> HTTP -> client). A process that blocks in epoll or select is woken by the kernel when its
bytes arrive: on the H200 host, a KVM guest without a cpuidle driver, a blocked reader's pipe round trip is
39 us where a polling one's is 12, and the Python it runs next starts with cold caches (a 1024-id body's
parse is ~110 us warm, 270-330 us after an idle gap on 2 cores). So both of the server's processes poll while
requests are in flight and for POLL_WINDOW_S after the last one (a closed-loop client's next request is well
inside it), and sleep after that: an idle server costs no CPU.

    polling_window(sleep_on_idle, cpus=None) -> seconds to keep polling after activity (0.0: never poll)
    PollWindow: when the window closes (`touch` opens it again); read by the engine process's idle reader
    LoopPoller(loop, window_s, busy): keeps an asyncio loop from sleeping in epoll while busy() or in the window

Polling takes a CPU while it runs, so it is off where there are few to take (POLL_MIN_CPUS): on a 2-core
machine the polling HTTP process would take the engine's CPU.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

POLL_WINDOW_S = 0.05  # after the last activity: a closed loop's next request comes ~0.1-1 ms after an answer
POLL_MIN_CPUS = 8  # each of the two server processes polls on a CPU of its own; clients and the engine need theirs


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def polling_window(sleep_on_idle: bool, cpus: int | None = None) -> float:
    """Seconds the server keeps polling after activity: POLL_WINDOW_S, or 0.0 (never) under --sleep-on-idle or
    on a machine with fewer than POLL_MIN_CPUS usable CPUs."""
    if sleep_on_idle:
        return 0.0
    return POLL_WINDOW_S if (usable_cpus() if cpus is None else cpus) >= POLL_MIN_CPUS else 0.0


def describe(window_s: float, sleep_on_idle: bool) -> str:
    """The start-up log line's words for the choice polling_window made."""
    if window_s > 0:
        return f"on while requests run and {window_s * 1e3:g} ms after (--sleep-on-idle turns it off)"
    if sleep_on_idle:
        return "off (--sleep-on-idle)"
    return f"off ({usable_cpus()} usable CPUs, fewer than {POLL_MIN_CPUS})"


class PollWindow:
    """Until when to poll: `touch` (any activity) opens the window for `window_s` more seconds."""

    def __init__(self, window_s: float) -> None:
        if window_s < 0:
            raise ValueError(f"window_s: {window_s} out of range (allowed >= 0)")
        self.window_s = window_s
        self.until = 0.0  # time.perf_counter() at which polling stops

    def touch(self) -> None:
        if self.window_s:
            self.until = time.perf_counter() + self.window_s

    def left(self) -> float:
        """Seconds until the window closes (<= 0: closed)."""
        return self.until - time.perf_counter()


class LoopPoller:
    """Keeps `loop` polling (its epoll never blocks) while `busy()` or until the window closes.

    One callback that re-schedules itself with call_soon: with a callback ready the loop polls its file
    descriptors with a zero timeout, so a pipe's or a socket's bytes are handled at the next turn, on a warm
    CPU. `touch` (on every arrival and every events frame) starts it again after it stopped.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, window_s: float, busy: Callable[[], bool]) -> None:
        self.loop = loop
        self.window = PollWindow(window_s)
        self.busy = busy
        self.running = False
        self.turns = 0  # the loop turns it kept (what the tests read)

    def touch(self) -> None:
        if not self.window.window_s:
            return
        self.window.touch()
        if not self.running:
            self.running = True
            self.loop.call_soon(self._turn)

    def _turn(self) -> None:
        self.turns += 1
        if self.busy() or self.window.left() > 0:
            self.loop.call_soon(self._turn)
        else:
            self.running = False
