"""ddtree.serving.validation's request ids: SGLang's shape (32 hex digits), unique within a process and across
the processes forked from it."""

from __future__ import annotations

import os

from ddtree.serving.validation import new_rid


def test_request_ids_are_32_hex_digits_and_never_repeat() -> None:
    rids = [new_rid() for _ in range(10_000)]
    assert len(set(rids)) == len(rids)
    assert all(len(r) == 32 and int(r, 16) >= 0 for r in rids)


def test_a_forked_process_draws_ids_of_its_own() -> None:
    read, write = os.pipe()
    before = new_rid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        os.write(write, new_rid().encode())
        os._exit(0)
    os.close(write)
    try:
        child = os.read(read, 64).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    after = new_rid()
    assert len(child) == 32 and child not in (before, after)
    assert child[:16] != before[:16]  # its own random prefix, not the parent's with the parent's next count
