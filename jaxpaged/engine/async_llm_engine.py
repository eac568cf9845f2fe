"""`AsyncLLMEngine`: the engine behind an event loop, for servers.

One background task steps the engine while requests are added and aborted concurrently, and
hands each request its outputs as they are produced (vLLM's `AsyncLLMEngine` does the same).

The engine is not thread-safe, and a step blocks for as long as the model runs. So every call
into its state (`step`, `add_request`, `abort_request`, `stats`) runs on one worker thread, the
engine's, in submission order: the event loop stays free to serve HTTP while a step runs, a
request added or aborted during a step takes effect right after it, before the next one. Work
that reads no engine state, and can take long for a large input (tokenizing a prompt, rendering
a chat template, decoding token ids), runs on a separate preprocessing pool instead, so that it
costs its own request time and never delays a step. (Hugging Face's fast tokenizers release
the GIL while they encode.)

A step that raises is isolated to the request it comes from (`LLMEngine.step`): that request's
stream raises `RequestFailedError` and the others go on. A fatal fault (`EngineDeadError`, see
`jaxpaged.errors`) stops the step loop: every unfinished request fails with it, later requests
are refused, and the callbacks given to `on_dead` run (the server exits on it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from jaxpaged.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.lora import LoRARequest
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sample.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
NUM_PREPROCESS_THREADS = 2  # tokenization and chat templating, off the engine's thread


class AsyncLLMEngine:
    """Wraps an `LLMEngine` (for example `LLM(...).llm_engine`) for use from asyncio.

    Use it from one event loop; `start()` there before the first request (or let the first
    `generate` start it), and `shutdown()` at the end.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._worker = concurrent.futures.ThreadPoolExecutor(1, "jaxpaged-engine")
        self._preprocessor = concurrent.futures.ThreadPoolExecutor(NUM_PREPROCESS_THREADS,
                                                                   "jaxpaged-preprocess")
        self._dead_callbacks: list[Callable[[], None]] = []
        self._streams: dict[str, RequestStream] = {}  # unfinished requests
        self._has_work: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._stats = engine.stats()  # as of the last call into the engine
        self.dead: EngineDeadError | None = None  # what stopped the step loop

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.scheduler_config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the step loop on the running event loop (idempotent)."""
        if self._loop_task is None:
            self._has_work = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def shutdown(self) -> None:
        """Stops the step loop, aborts what is left, and waits for the worker thread."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for stream in list(self._streams.values()):
            stream.close()
        self._worker.shutdown(wait=True)
        self._preprocessor.shutdown(wait=True)

    def on_dead(self, callback: Callable[[], None]) -> None:
        """Calls `callback()` on the event loop once, when a fatal fault stops the engine."""
        self._dead_callbacks.append(callback)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Runs `fn(*args)` on the engine's thread, after what is already queued there."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, self._call,
                                                                fn, *args)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        finally:
            self._stats = self.engine.stats()

    async def embed(self, token_ids: list[list[int]], pooling: str = "last",
                    normalize: bool = True):
        """`LLMEngine.embed` on the engine's thread (between steps): f32[n, hidden_size]."""
        return await self.run(self.engine.embed, token_ids, pooling, normalize)

    async def preprocess(self, fn: Callable[..., T], *args) -> T:
        """Runs `fn(*args)` on the preprocessing pool: for work that reads no engine state."""
        return await asyncio.get_running_loop().run_in_executor(self._preprocessor, fn, *args)

    # -- requests ---------------------------------------------------------------------------

    async def add_request(self, prompt: str | dict, params: SamplingParams,
                          request_id: str, priority: int = 0,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Queues a request; returns the stream of its outputs. Validates before queueing.

        Args:
          prompt: text (tokenized on the preprocessing pool), or
            `{"prompt_token_ids": [...], "prompt": optional text}`.
          request_id: unique among unfinished requests.
          priority: lower first, under the engine's "priority" scheduling policy.
          lora_request: the adapter it runs under (`LLMEngine.add_request`).

        Raises:
          InvalidRequestError (a ValueError): the prompt, parameters or request id are invalid,
            naming the field (nothing was queued).
          EngineDeadError: the step loop has stopped on a fatal fault.
        """
        if isinstance(prompt, str):
            text, ids = await self.tokenize_prompt(prompt)
            prompt = {"prompt": text, "prompt_token_ids": ids}
        if self.dead is not None:
            raise EngineDeadError(str(self.dead)) from self.dead
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"request_id {request_id!r} is already in use")
        if params.structured_outputs is not None:
            # Compiled here, off the engine's thread; the engine then copies the cached grammar.
            await self.compile_constraint(params.structured_outputs)
        self.start()
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        try:
            await self.run(self.engine.add_request, prompt, params, request_id, priority,
                           lora_request)
        except ValueError:
            del self._streams[request_id]
            raise
        except BaseException:  # cancelled while the add was queued: undo it once it has run
            stream.close()
            raise
        self._has_work.set()
        return stream

    async def generate(self, prompt: str | dict, params: SamplingParams, request_id: str,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """`add_request`, then its outputs; leaving the loop early aborts the request."""
        stream = await self.add_request(prompt, params, request_id, lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        """Aborts a request (unknown ids are ignored); its stream ends."""
        stream = self._streams.pop(request_id, None)
        await self.run(self.engine.abort_request, request_id)
        if stream is not None:
            stream.put(None)

    def _abort_soon(self, request_id: str) -> None:
        """Queues an abort without awaiting it (callable from a cancelled task's cleanup)."""
        self._streams.pop(request_id, None)
        try:
            self._worker.submit(self._call, self.engine.abort_request, request_id)
        except RuntimeError:  # after shutdown(): the engine is gone, nothing holds blocks
            pass

    async def compile_constraint(self, constraint: StructuredOutputsParams) -> None:
        """Compiles a structured-output constraint into the grammar cache, on the
        preprocessing pool; raises InvalidRequestError if it is invalid."""
        await self.preprocess(self.engine.grammar_compiler.matcher, constraint)

    async def tokenize_prompt(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """`InputProcessor.tokenize_prompt` on the preprocessing pool."""
        return await self.preprocess(self.engine.input_processor.tokenize_prompt, prompt)

    async def chat_prompt(self, messages: list[dict], **template_kwargs) -> tuple[str, list[int]]:
        """`InputProcessor.chat_prompt` on the preprocessing pool."""
        processor = self.engine.input_processor
        return await self.preprocess(lambda: processor.chat_prompt(messages, **template_kwargs))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, on the preprocessing pool."""
        return await self.preprocess(
            lambda: self.engine.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    async def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids`, special tokens included, on the preprocessing pool."""
        return await self.preprocess(self.engine.tokenizer.decode, token_ids)

    # -- weights (the research API, between steps) ------------------------------------------

    async def update_params(self, params) -> None:
        """`LLMEngine.update_params` on the engine's thread: applied between two steps, so the
        next step runs with the new weights (running requests keep the K/V they have)."""
        await self.run(self.engine.update_params, params)

    async def load_weights(self, weights) -> None:
        """`LLMEngine.load_weights` on the engine's thread, between two steps."""
        await self.run(self.engine.load_weights, list(weights))

    async def sleep(self, level: int = 1) -> None:
        """`LLMEngine.sleep` on the engine's thread, between two steps."""
        await self.run(self.engine.sleep, level)

    async def wake_up(self) -> None:
        """`LLMEngine.wake_up` on the engine's thread, between two steps."""
        await self.run(self.engine.wake_up)

    async def reset_prefix_cache(self) -> bool:
        """`LLMEngine.reset_prefix_cache` between steps; False while requests run."""
        return await self.run(self.engine.reset_prefix_cache)

    def stats(self) -> dict[str, int]:
        """`LLMEngine.stats()` as of the last call into the engine (no waiting on a step)."""
        return dict(self._stats)

    # -- the step loop ----------------------------------------------------------------------

    async def _step_loop(self) -> None:
        while True:
            await self._has_work.wait()
            try:
                outputs = await self.run(self.engine.step)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # fatal (per-request faults come back as failed outputs)
                logger.exception("a fatal fault stopped the engine")
                if not isinstance(e, EngineDeadError):
                    dead = EngineDeadError(f"a step raised {type(e).__name__}: {e}")
                    dead.__cause__, e = e, dead
                self.dead = e
                for stream in self._streams.values():
                    stream.put(self.dead)
                self._streams.clear()
                for callback in self._dead_callbacks:
                    callback()
                return
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
                    if output.finished:
                        self._streams.pop(output.request_id, None)
            # Requests added while the step ran are in the engine already (their add ran on
            # the worker before this check could), so this never clears a pending wake-up.
            if not self.engine.has_unfinished_requests():
                self._has_work.clear()


class RequestStream:
    """The outputs of one request, as an async iterator; `close()` aborts it if unfinished.

    Ends after the output with `finished=True`, or early (no error) if the request is aborted.

    Raises (from iteration):
      RequestFailedError: a fault in a step was traced to this request (it has ended).
      EngineDeadError: a fatal fault stopped the engine.
    """

    def __init__(self, request_id: str, engine: AsyncLLMEngine):
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()  # outputs; None = aborted; or an error
        self.finished = False

    def put(self, item: RequestOutput | BaseException | None) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise EngineDeadError(str(item)) from item
        self.finished = item.finished
        if item.error is not None:
            raise RequestFailedError(item.error)
        return item

    def close(self) -> None:
        """Aborts the request unless it finished; synchronous, so safe in any cleanup."""
        if not self.finished:
            self.finished = True
            self._engine._abort_soon(self.request_id)
