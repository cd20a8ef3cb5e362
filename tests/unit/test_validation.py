"""ddtree.serving.validation: request ids (SGLang's shape, 32 hex digits, unique within a process and across the
processes forked from it) and the sampling fields kept from one request to the next."""

from __future__ import annotations

import os

import pytest

from ddtree.errors import RequestError
from ddtree.serving.validation import new_rid, parse_sampling


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


def test_sampling_fields_seen_before_give_the_same_answer_and_a_type_is_part_of_the_question() -> None:
    first = parse_sampling({"temperature": 0, "max_new_tokens": 4})
    assert parse_sampling({"temperature": 0, "max_new_tokens": 4}) is first  # kept
    assert first.temperature == 0.0 and first.max_new_tokens == 4
    for _ in range(2):  # 0 was fine; false (== 0, same hash) is not a number, however often it is sent
        with pytest.raises(RequestError, match=r"sampling_params\.temperature: Input should be a valid number"):
            parse_sampling({"temperature": False, "max_new_tokens": 4})
    assert parse_sampling({"max_new_tokens": 4}, "sampling_params.1") is not parse_sampling({"max_new_tokens": 4})
    with pytest.raises(RequestError, match=r"sampling_params\.1\.top_k"):  # the caller's field names, kept apart
        parse_sampling({"top_k": "x"}, "sampling_params.1")
    assert parse_sampling({"stop": ["a", "b"]}).stop == ["a", "b"]  # a list: not a key, parsed each time
    with pytest.raises(RequestError, match="unknown field"):
        parse_sampling({"stop": ["a"], "nope": 1})
