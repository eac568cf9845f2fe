"""Streaming helpers of the OpenAI routes: server-sent events, what a stream has sent, several
engine streams merged, streams closed when their client leaves."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import weakref
from collections.abc import AsyncIterator

from pydantic import BaseModel

from jaxpaged.engine.async_llm_engine import RequestStream
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.server import protocol as api


def sse(data: BaseModel | dict | str) -> str:
    """One server-sent event."""
    if isinstance(data, BaseModel):
        data = data.model_dump_json()
    elif isinstance(data, dict):
        data = api.ErrorResponse.model_validate(data).model_dump_json()
    return f"data: {data}\n\n"


class Progress:
    """What a stream has sent of each choice: its characters so far (for the text offsets of
    logprobs), and which choices have finished. The engine's outputs are deltas (DELTA)."""

    def __init__(self):
        self.sent_chars: dict[int, int] = {}
        self.done: set[int] = set()

    def advance(self, index: int, c: CompletionOutput, with_tokens: bool,
                send_first: bool = False) -> int | None:
        """The characters of choice `index` sent before, if the delta `c` has something to
        send (text, tokens when `with_tokens`, its finish, or anything at all the first time
        when `send_first`); None when there is nothing new or the choice has finished."""
        if index in self.done:
            return None
        if not (c.text or (with_tokens and c.token_ids) or c.finish_reason
                or (send_first and index not in self.sent_chars)):
            return None
        sent = self.sent_chars.get(index, 0)
        self.sent_chars[index] = sent + len(c.text)
        if c.finish_reason:
            self.done.add(index)
        return sent


def closing(events: AsyncIterator[str], streams: list[RequestStream]) -> AsyncIterator[str]:
    """`events`, with its requests aborted when it is dropped even if never started (a client
    that disconnects before the first chunk; an unstarted generator runs no `finally`)."""
    weakref.finalize(events, lambda: [stream.close() for stream in streams])
    return events


def drop_none_deltas(chunk: api.ChatCompletionChunk) -> str:
    """JSON of a chunk whose deltas carry only the fields they set (`role` once, then text)."""
    data = chunk.model_dump(mode="json")
    for choice, original in zip(data["choices"], chunk.choices):
        choice["delta"] = original.delta.model_dump(mode="json", exclude_none=True)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


class PromptOnly:
    """A request's stream with its one generated token left out of each output (an echo with
    `max_tokens` 0): no text, ids or logprobs, finish reason "length"."""

    def __init__(self, stream: RequestStream):
        self.stream = stream

    def close(self) -> None:
        self.stream.close()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for output in self.stream:
            yield dataclasses.replace(output, outputs=[dataclasses.replace(
                c, text="", token_ids=[], cumulative_logprob=0.0,
                logprobs=None if c.logprobs is None else [],
                finish_reason=c.finish_reason and "length", stop_reason=None)
                for c in output.outputs])


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several streams' outputs in arrival order, as (stream index, output)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream):
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
