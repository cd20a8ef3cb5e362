"""From a request's progress to what the client gets: text, stop strings, finish reason, log-probs, SSE plumbing.

A `Reply` reads one job's `Progress` (the engine's committed tokens) and derives the answer: the text,
cut at a stop string (ddtree.serving.stops) with the token ids cut to match, SGLang's finish_reason,
and `meta_info`. `collect` and `follow` drive a RequestStream for a plain and a streamed answer; a
stop string ends the engine request there. The native routes (api.py) and /v1 (openai_api.py) share
all of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from ddtree.errors import RequestError
from ddtree.serving import stamps
from ddtree.serving.state import Progress, RequestStream, ServerState
from ddtree.serving.stops import find_stop, held_back, tokens_for
from ddtree.serving.validation import Job
from ddtree.text import IncrementalDecoder

SSE_DONE = b"data: [DONE]\n\n"


class FastJSONResponse(JSONResponse):
    """A JSON answer encoded by orjson (several times json's speed on a list of output ids)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(status: int, message: str, field: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "field": field, "code": status}}, status_code=status)


def error_chunk(err: RequestError) -> bytes:
    return sse({"error": {"message": str(err), "field": err.field, "code": err.status_code}})


def sse(data: Any) -> bytes:
    """One SSE event, as the bytes that go out (a str would be decoded from orjson's bytes and encoded again)."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


class EventStream(StreamingResponse):
    """SSE response that runs `on_close` however it ends: finished, client gone, or server stopping.

    Starlette streams and listens for the client's disconnect in an anyio task group, which cost ~0.2-0.6 ms
    before a stream's first chunk on a 2-core machine (most of a request's time to first token beyond the
    engine's); here one plain asyncio task listens and cancels the stream when the client goes.

    The chunk that ends with `data: [DONE]` also ends the response: it goes out in one write with the
    chunked body's terminator. Sent a write later (Starlette's empty last message), the terminator was
    often not there yet when a client stopped reading at [DONE], and aiohttp then closed the connection
    instead of reusing it (4 new connections in 20 streams on 2 cores): the next request connected anew.
    The listener starts once the first chunk is out, not before it (a task made on the way to the first token).
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close
        self._after_first: Callable[[], None] | None = None

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            if not ended:
                ended = chunk.endswith(SSE_DONE)
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
                if self._after_first is not None and not ended:
                    self._after_first()
                self._after_first = None
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        active, gone = True, False

        async def listen() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if active and streaming is not None:
                gone = True
                streaming.cancel()

        listener: asyncio.Task[None] | None = None

        def start_listening() -> None:
            nonlocal listener
            listener = asyncio.get_running_loop().create_task(listen())

        self._after_first = start_listening
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone:
                raise
            streaming.uncancel()  # type: ignore[union-attr]  # the client left: a normal end of this response
        except OSError:
            pass  # the client left while a chunk was being written
        finally:
            active = False
            if listener is not None:
                listener.cancel()
            self._on_close()


def sse_response(state: ServerState, pairs: list[tuple[RequestStream, Reply]], chunks: AsyncIterator[bytes]) -> EventStream:
    """An SSE response of `chunks`: a RequestError met on the way becomes an error chunk, `[DONE]` always ends
    it (`chunks` may end its last chunk with it, so that both go out in one write), and every request of
    `pairs` is cancelled however the response ends (client gone included)."""

    async def guarded() -> AsyncIterator[bytes]:
        done = False
        try:
            async for chunk in chunks:
                done = chunk.endswith(SSE_DONE)
                if done and stamps.ON:
                    _stamp_done(pairs)
                yield chunk
        except RequestError as err:
            done = False
            yield error_chunk(err)
        if not done:
            if stamps.ON:
                _stamp_done(pairs)
            yield SSE_DONE

    def close() -> None:
        for stream, _ in pairs:
            state.cancel(stream)
            if stamps.ON:
                stamps.stamp(stream.progress.request.request_id, "h_closed")

    return EventStream(guarded(), close)


def _stamp_done(pairs: list[tuple[RequestStream, Reply]]) -> None:
    for stream, _ in pairs:
        stamps.stamp(stream.progress.request.request_id, "h_done")


class Reply:
    """The answer to one job so far; `update()` after every round of its progress."""

    def __init__(self, job: Job, progress: Progress, state: ServerState) -> None:
        self.job = job
        self.progress = progress
        self._codec = state.codec
        self._eos = state.engine.eos_token_id
        self.ids: list[int] = []
        self.text = ""
        self.matched: str | None = None  # the stop string that ended it
        self._searched = 0  # text before this offset holds no stop string
        self._seen: tuple[int, bool] = (0, False)  # the progress the answer was last derived from
        # while running only new ids are decoded; once finished, all of them, unless the codec's text of the ids
        # so far is exact (concatenative): then only those it has not confirmed
        self._running_text = IncrementalDecoder(self.decode, getattr(self._codec, "concatenative", False))

    def decode_ahead(self) -> None:
        """Decode the ids that have come while running (with a concatenative codec, whose text of them stays exact):
        a plain answer then decodes only its last event's ids when it finishes, not the whole output."""
        if not self.progress.finished:
            try:
                self._running_text.extend(self.progress.output_ids)
            except Exception:  # called from the events' dispatch, which serves every request: the finish's
                pass  # update decodes these ids again and fails this request alone, as it would without this

    def decode(self, ids: list[int]) -> str:
        if self._codec is None:
            return ""
        return self._codec.decode(ids, skip_special_tokens=self.job.output.skip_special_tokens)

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    @property
    def finished(self) -> bool:
        return self.stopped or self.progress.finished

    def update(self) -> None:
        """Derive the answer from the progress; nothing to do when it has not moved since (a plain answer's
        last update after its finish decoded all of its text a second time)."""
        seen = (len(self.progress.output_ids), self.progress.finished)
        if self.stopped or seen == self._seen:
            return
        self._seen = seen
        ids = list(self.progress.output_ids)
        # the exact text once finished; while running the incremental one, which holds back an unfinished character
        text = self._running_text.whole(ids) if self.progress.finished else self._running_text.extend(ids)
        out = self.job.output
        if out.stop and len(ids) >= max(out.min_new_tokens, 1):
            start = max(0, self._searched - max(len(s) for s in out.stop) + 1)
            while (hit := find_stop(text, out.stop, start)) is not None:
                at, stop = hit
                end = at + len(stop)
                keep = tokens_for(ids, end, self.decode)
                if keep >= out.min_new_tokens:
                    self.ids, self.matched = ids[:keep], stop
                    self.text = text[:end] if out.no_stop_trim else text[:at]
                    return
                start = at + 1
            self._searched = len(text)
        if self.progress.finish_reason == "stop" and ids and not out.no_stop_trim:
            text = self._running_text.whole(ids[:-1])  # SGLang: a stop token stays in output_ids, its text is trimmed
        self.ids, self.text = ids, text

    def stream_text(self) -> str:
        """The text a stream may send now: not a tail that a stop string or an unfinished character may change."""
        if self.finished:
            return self.text
        text = self.text.rstrip("\ufffd")  # a multi-byte character whose last bytes are still to come
        return text[: len(text) - held_back(text, self.job.output.stop)]

    @property
    def finish_reason(self) -> str | None:
        return "stop" if self.stopped else self.progress.finish_reason

    @property
    def matched_stop(self) -> int | str | None:
        """What ended it: a stop string, a stop token id (EOS included), or None (length, abort, running)."""
        if self.stopped:
            return self.matched
        if self.progress.finish_reason == "stop":
            return self.ids[-1] if self.ids else self._eos
        return None

    def finish_dict(self) -> dict[str, Any] | None:
        reason = self.finish_reason
        if reason is None:
            return None
        if reason == "length":
            return {"type": "length", "length": len(self.ids)}
        if reason == "stop":
            return {"type": "stop", "matched": self.matched_stop}
        return {"type": reason, "message": "request aborted"}

    def token_logprobs(self) -> list[float]:
        """The target's log-prob of each kept token (the engine reports them when the request asked)."""
        return list(getattr(self.progress, "output_logprobs", ()))[: len(self.ids)]

    def meta_info(self) -> dict[str, Any]:
        """SGLang's meta_info: the engine's counts from the progress, the token counts of the reply's own ids
        (a stop string may have cut them)."""
        progress = self.progress
        verify = progress.verify_steps
        meta: dict[str, Any] = {
            "id": progress.request.request_id,
            "prompt_tokens": len(progress.request.prompt_ids),
            "completion_tokens": len(self.ids),
            "cached_tokens": 0,
            "finish_reason": self.finish_dict(),
            "e2e_latency": time.perf_counter() - progress.started,
            "first_token_latency": progress.first_token_latency,
            "spec_verify_ct": verify,
            "spec_accept_length": len(self.ids) / verify if verify else 0.0,
            "spec_accept_histogram": list(progress.accept_histogram),
            "spec_num_correct_drafts": progress.correct_drafts,
        }
        if self.job.output.logprobs:
            texts = [self.decode([t]) if self.job.output.text_in_logprobs else None for t in self.ids]
            meta["output_token_logprobs"] = [list(e) for e in zip(self.token_logprobs(), self.ids, texts)]
            meta["input_token_logprobs"] = []
        return meta

    def usage(self) -> dict[str, int]:
        prompt = len(self.progress.request.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": len(self.ids), "total_tokens": prompt + len(self.ids)}


def submit_all(state: ServerState, jobs: list[Job]) -> list[tuple[RequestStream, Reply]]:
    """Queue every job or none: a refused one (e.g. a duplicate rid) cancels those already queued.

    A job with stop strings is woken every round even when not streamed, so a stop string ends it early; one
    without decodes its text as its events arrive where the codec allows it (Reply.decode_ahead).
    """
    out: list[tuple[RequestStream, Reply]] = []
    try:
        for job in jobs:
            woken = job.stream or bool(job.output.stop)
            stream = state.submit(job.request, stream=woken)
            reply = Reply(job, stream.progress, state)
            if not woken and getattr(state.codec, "concatenative", False):
                stream.on_event = reply.decode_ahead
            out.append((stream, reply))
    except RequestError:
        for stream, _ in out:
            state.cancel(stream)
        raise
    return out


async def collect(state: ServerState, pairs: list[tuple[RequestStream, Reply]]) -> list[Reply]:
    """Every reply, finished; whatever happens, nothing is left running."""
    try:
        for stream, reply in pairs:
            async for _ in stream.updates():
                reply.update()
                if reply.stopped:
                    break
            reply.update()
    finally:
        for stream, _ in pairs:
            state.cancel(stream)  # no-op for finished ones; a dropped handler or a stop string must not leave work behind
    return [reply for _, reply in pairs]


async def follow(state: ServerState, stream: RequestStream, reply: Reply) -> AsyncIterator[Reply]:
    """Wait for the first round (so a refused prefill can still be a 4xx), then yield the reply after every round."""
    updates = stream.updates()
    try:
        await anext(updates)
    except BaseException:
        state.cancel(stream)
        raise
    reply.update()
    return _follow(state, stream, reply, updates)


async def _follow(state: ServerState, stream: RequestStream, reply: Reply, updates: AsyncIterator[Progress]) -> AsyncIterator[Reply]:
    yield reply
    if reply.finished:
        state.cancel(stream)
        return
    async for _ in updates:
        reply.update()
        yield reply
        if reply.stopped:
            state.cancel(stream)
            return


async def follow_all(state: ServerState, pairs: list[tuple[RequestStream, Reply]]) -> AsyncIterator[Reply]:
    """Several replies' updates, interleaved as their rounds arrive (a stream of n choices, or of several prompts).

    Every first round is awaited before the first chunk, as in `follow`, so a refused prefill is still a 4xx.
    """
    followed: list[AsyncIterator[Reply]] = []
    try:
        for stream, reply in pairs:
            followed.append(await follow(state, stream, reply))
    except BaseException:
        for stream, _ in pairs:
            state.cancel(stream)
        raise
    if len(followed) == 1:
        return followed[0]
    return _interleave(followed)


async def _interleave(iterators: list[AsyncIterator[Reply]]) -> AsyncIterator[Reply]:
    queue: asyncio.Queue[Reply | BaseException | None] = asyncio.Queue()

    async def pump(it: AsyncIterator[Reply]) -> None:
        try:
            async for reply in it:
                await queue.put(reply)
        except Exception as err:  # a failed request: the stream reports it (an error chunk)
            await queue.put(err)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(it)) for it in iterators]
    left = len(tasks)
    try:
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
