"""`/v1/completions` and `/v1/chat/completions`: validated requests in, engine streams out.

Each prompt of a request becomes one engine request (`{request id}-{prompt index}`); choice
`i * n + j` is completion `j` of prompt `i`. Every prompt is tokenized, length-checked and added
before any response byte is sent, so a bad request gets a 400 and leaves nothing queued. A
streamed request asks the engine for `DELTA` outputs, which become the chunks as they are; any
other asks for `FINAL_ONLY`. Streams carry server-sent events in OpenAI's chunk format and end
with `data: [DONE]`; leaving a stream early (the client disconnects) aborts its engine requests. A request that fails in the engine
gets a 500 (or, once streaming, an error event before `[DONE]`) with the reason.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import AsyncIterator, Callable

from jaxpaged.engine.async_llm_engine import AsyncLLMEngine, RequestStream
from jaxpaged.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.server import protocol as api
from jaxpaged.server.chat_utils import answer_message, has_constraint, template_message
from jaxpaged.server.errors import APIError, failed_in_engine
from jaxpaged.server.logprobs import chat_logprobs, completion_logprobs, routed_experts
from jaxpaged.reasoning import ReasoningStream, get_reasoning_parser
from jaxpaged.server.streams import (Progress, PromptOnly, closing, drop_none_deltas, merge,
                                     sse)
from jaxpaged.server.tool_calls import (TOOL_CALL_PARSERS, NamedFunction, RequiredCalls,
                                        ToolCallStream, parameters_schema)
from jaxpaged.sample.structured_outputs import StructuredOutputsParams
from jaxpaged.lora import LoRARequest
from jaxpaged.server.lora import LoRAServing


class OpenAIServing:
    """Handlers for one served model. `on_finished(output)` sees each finished request."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str,
                 on_finished: Callable[[RequestOutput], None] = lambda output: None,
                 tool_call_parser: str | None = None, generation_defaults: dict | None = None):
        """`tool_call_parser`: a name in `TOOL_CALL_PARSERS`, to allow `tool_choice="auto"`.
        `generation_defaults`: the sampling values a request leaves out (`LLM.generation_defaults`:
        the model's generation config), `max_tokens` among them. The reasoning parser is the
        engine's (`EngineConfig.reasoning`, `LLM(reasoning_parser=...)`): with one, the
        thinking is returned as `reasoning_content`.

        Raises:
          ValueError: an unknown `tool_call_parser`."""
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser {tool_call_parser!r} is not one of "
                             f"{sorted(TOOL_CALL_PARSERS)}")
        self.engine = engine
        self.model_name = model_name
        self.on_finished = on_finished
        self.tool_call_parser = tool_call_parser
        self.defaults = dict(generation_defaults or {})
        self.reasoning = get_reasoning_parser(engine.engine.reasoning_parser)
        # (<think>, </think>) ids, to count reasoning tokens; None for tags of several tokens,
        # and then the engine cannot hold structured outputs back until the reasoning ends.
        self.think_token_ids = engine.engine.think_token_ids
        self.constraints_after_reasoning = self.think_token_ids is not None
        self.lora = LoRAServing(engine, model_name)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter that `model` names, None for the base model; 404 for anything else."""
        return self.lora.resolve(model)

    # -- shared steps -----------------------------------------------------------------------

    def _max_tokens(self, requested: int | None, num_prompt_tokens: int,
                    prompt_param: str = "prompt", param: str = "max_tokens") -> int:
        """`requested`, or when None the generation config's `max_tokens` within the room left
        (all of it without one); 400 past `max_model_len` naming `param`, or `prompt_param` if
        the prompt alone leaves no room."""
        limit = self.engine.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(f"the prompt has {num_prompt_tokens} tokens, which leaves no room for "
                           f"output under this model's maximum context length of {limit}",
                           param=prompt_param)
        if requested is None:
            return min(limit - num_prompt_tokens,
                       self.defaults.get("max_tokens", limit - num_prompt_tokens))
        if num_prompt_tokens + requested > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, "
                f"{requested} for the completion). Reduce the prompt or {param}.",
                param=param)
        return requested

    async def _tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        try:
            return await self.engine.tokenize_prompt(prompt)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from e

    async def _add(self, request_id: str, prompts: list[tuple[str | None, list[int]]],
                   make_params: Callable, param_names: dict[str, str], priority: int = 0,
                   lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """Adds one engine request per prompt; on any error, aborts those already added.

        An engine `InvalidRequestError` becomes a 400 whose `param` is the field's name in this
        route's request (`param_names` maps the engine's names that differ)."""
        streams = []
        try:
            for i, (text, ids) in enumerate(prompts):
                # Validation (and a stop-string automaton) can take a while for a large request:
                # off the event loop, as tokenization is.
                params = await self.engine.preprocess(make_params, ids)
                streams.append(await self.engine.add_request(
                    {"prompt": text, "prompt_token_ids": ids}, params, f"{request_id}-{i}",
                    priority, lora_request))
        except (ValueError, EngineDeadError) as e:
            for stream in streams:
                stream.close()
            if isinstance(e, EngineDeadError):
                raise APIError("the engine stopped on a fatal fault", 503,
                               type="server_error") from e
            param = getattr(e, "param", None)
            raise APIError(str(e), param=param_names.get(param, param)) from e
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams

    async def _outputs(self, streams: list[RequestStream]
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as the engine produces them; closing aborts the rest."""
        try:
            async for i, output in merge(streams):
                if output.finished:
                    self.on_finished(output)
                yield i, output
        finally:
            for stream in streams:
                stream.close()

    async def _final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, output in self._outputs(streams):
                finals[i] = output
        except (RequestFailedError, EngineDeadError) as e:
            raise failed_in_engine(e) from e
        if not all(f is not None and f.finished for f in finals):
            raise APIError("the request was aborted", 500, type="server_error")
        return finals

    @staticmethod
    def _usage(finals: list[RequestOutput], num_completion_tokens: int | None = None
               ) -> api.UsageInfo:
        """Tokens of the finished requests' prompts and of their completions (counted from the
        final outputs, unless a stream of deltas counted them)."""
        prompt = sum(len(f.prompt_token_ids) for f in finals)
        completion = (sum(len(c.token_ids) for f in finals for c in f.outputs)
                      if num_completion_tokens is None else num_completion_tokens)
        return api.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                             total_tokens=prompt + completion)

    # -- /v1/completions --------------------------------------------------------------------

    async def create_completion(self, req: api.CompletionRequest
                                ) -> api.CompletionResponse | AsyncIterator[str]:
        """The response, or an iterator of SSE strings when `req.stream`.

        Raises:
          APIError: 400 for invalid parameters or prompts, 404 for an unknown model.
        """
        lora = self.check_model(req.model)
        if req.suffix is not None:
            raise APIError("suffix is not supported", param="suffix")
        # max_tokens 0 scores the prompt (OpenAI's and vLLM's echo-only request): one token is
        # generated, as the engine always does, and left out of the response.
        prompt_only = req.max_tokens == 0
        if prompt_only and not req.echo:
            raise APIError("max_tokens must be at least 1 (0 only with echo, to return the "
                           "prompt and its logprobs)", param="max_tokens")
        if req.stream and req.best_of not in (None, req.n):
            raise APIError("best_of must equal n when streaming", param="best_of")
        # (text, ids, the first token's text): echo needs the text, also of token-id prompts
        prompts = [(text, ids, None) for text, ids in
                   [await self._tokenize(p) for p in _split_prompts(req.prompt)]]
        if req.echo:
            prompts = [(text if text is not None else await self.engine.decode(ids), ids,
                        await self.engine.decode(ids[:1])) for text, ids, _ in prompts]

        def make_params(ids):
            max_tokens = 1 if prompt_only else req.max_tokens
            return req.sampling_params(self._max_tokens(max_tokens, len(ids)), req.logprobs,
                                       req.logprobs if req.echo else None, req.best_of,
                                       defaults=self.defaults)

        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._add(request_id, [p[:2] for p in prompts], make_params,
                                  {"prompt_logprobs": "logprobs",
                                   "structured_outputs": req.constraint_field}, req.priority,
                                  lora)
        if prompt_only:
            streams = [PromptOnly(stream) for stream in streams]
        if req.stream:
            return closing(self._completion_stream(req, request_id, prompts, streams), streams)
        finals = await self._final_outputs(streams)
        choices = [self._completion_choice(req, i * req.n + c.index, prompts[i], f, c)
                   for i, f in enumerate(finals) for c in f.outputs]
        return api.CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=self._usage(finals))

    def _completion_choice(self, req: api.CompletionRequest, index: int,
                           prompt: tuple[str, list[int]], output: RequestOutput,
                           c: CompletionOutput, sent_chars: int | None = None,
                           prompt_logprobs: list | None = None) -> api.CompletionChoice:
        """Choice `index` from `c`: a final output, or in a stream the delta after `sent_chars`
        characters sent in earlier chunks (None: the choice's first chunk). An echoed choice
        starts with the prompt (and its `prompt_logprobs`, by default the output's) the first
        time it is sent."""
        echo = req.echo and sent_chars is None
        logprobs = None
        if req.logprobs is not None:
            ids, lps = c.token_ids, c.logprobs
            offset = (sent_chars or 0) + (len(prompt[0]) if req.echo else 0)
            if echo:  # the prompt's first token has no log-probability: None, as in OpenAI's
                plp = output.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
                ids, lps, offset = output.prompt_token_ids + ids, plp + lps, 0
            logprobs = completion_logprobs(ids, lps, offset, first_token_text=prompt[2])
        return api.CompletionChoice(index=index, text=prompt[0] + c.text if echo else c.text,
                                    logprobs=logprobs, finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason, routed_experts=routed_experts(c))

    def _completion_stream(self, req, request_id, prompts, streams) -> AsyncIterator[str]:
        created = int(time.time())
        prompt_logprobs = {}  # prompt index -> its logprobs (in the first delta only)

        def chunk(choices, usage=None):
            return sse(api.CompletionResponse(id=request_id, created=created,
                                              model=self.model_name, choices=choices,
                                              usage=usage))

        def choices_of(i: int, output: RequestOutput, progress: Progress) -> list:
            if output.prompt_logprobs is not None:
                prompt_logprobs[i] = output.prompt_logprobs
            choices = []
            for c in output.outputs:
                index = i * req.n + c.index
                first = index not in progress.sent_chars
                sent = progress.advance(index, c, req.logprobs is not None, req.echo)
                if sent is not None:
                    choices.append(self._completion_choice(
                        req, index, prompts[i], output, c, None if first else sent,
                        prompt_logprobs.get(i)))
            return choices

        return self._events(streams, chunk, choices_of, req.include_usage)

    async def _events(self, streams: list[RequestStream], chunk: Callable, choices_of: Callable,
                      include_usage: bool, first_choices: list | None = None
                      ) -> AsyncIterator[str]:
        """A stream's SSE events: `first_choices` if given, then one chunk per engine output
        with something new (`choices_of(prompt index, output, progress)`), the usage chunk if
        asked, an error event if the engine fails, and `[DONE]` last."""
        progress, finals, num_completion_tokens = Progress(), [], 0
        try:
            if first_choices is not None:
                yield chunk(first_choices)
            async for i, output in self._outputs(streams):
                choices = choices_of(i, output, progress)
                if choices:
                    yield chunk(choices)
                num_completion_tokens += sum(len(c.token_ids) for c in output.outputs)
                if output.finished:
                    finals.append(output)
            if include_usage:
                yield chunk([], self._usage(finals, num_completion_tokens))
        except (RequestFailedError, EngineDeadError) as e:
            yield sse(failed_in_engine(e).body())
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions ---------------------------------------------------------------

    async def create_embedding(self, req: api.EmbeddingRequest) -> api.EmbeddingResponse:
        """Pooled hidden states of each input (`LLMEngine.embed`), as floats or base64.

        Raises:
          APIError: 400 for an invalid input or `dimensions` (this model has one size), 404 for
            an unknown model.
        """
        if self.check_model(req.model) is not None:
            raise APIError("embeddings are the base model's: an adapter's are not served",
                           param="model")
        if req.dimensions is not None:
            raise APIError("dimensions is not supported: this model's embeddings have one size "
                           "(its hidden size)", param="dimensions")
        ids = []
        for prompt in _split_prompts(req.input, "input"):
            try:
                ids.append((await self.engine.tokenize_prompt(prompt))[1])
            except ValueError as e:
                raise APIError(str(e), param="input") from e
        try:
            vectors = await self.engine.embed(ids, req.pooling, req.normalize)
        except ValueError as e:
            raise APIError(str(e), param=getattr(e, "param", None) or "input") from e
        except EngineDeadError as e:
            raise APIError("the engine stopped on a fatal fault", 503,
                           type="server_error") from e
        data = [api.EmbeddingData(index=i, embedding=(
            base64.b64encode(v.astype("<f4").tobytes()).decode()
            if req.encoding_format == "base64" else v.tolist())) for i, v in enumerate(vectors)]
        n = sum(map(len, ids))
        return api.EmbeddingResponse(data=data, model=self.model_name,
                                     usage=api.UsageInfo(prompt_tokens=n, total_tokens=n))

    async def create_chat_completion(self, req: api.ChatCompletionRequest
                                     ) -> api.ChatCompletionResponse | AsyncIterator[str]:
        """The response, or an iterator of SSE strings when `req.stream`.

        Raises:
          APIError: 400 for invalid parameters or messages, 404 for an unknown model.
        """
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams, tool_calls = await self.start_chat(req, request_id)
        if req.stream:
            return closing(self._chat_stream(req, request_id, streams, tool_calls), streams)
        [final] = await self._final_outputs(streams)
        choices = []
        for c in final.outputs:
            reasoning, message, finish_reason = self.assistant_message(c, tool_calls)
            choices.append(api.ChatChoice(
                index=c.index, message=message, finish_reason=finish_reason,
                logprobs=self._chat_logprobs(req, c.token_ids, c.logprobs),
                stop_reason=c.stop_reason, routed_experts=routed_experts(c)))
        return api.ChatCompletionResponse(id=request_id, model=self.model_name,
                                          choices=choices, usage=self._usage([final]))

    async def start_chat(self, req: api.ChatCompletionRequest, request_id: str
                         ) -> tuple[list[RequestStream], Callable[[], ToolCallStream] | None]:
        """Checks a chat request, renders its prompt and adds it to the engine: its stream,
        and what reads its tool calls (`_tool_calls`). Shared with `/v1/responses`.

        Raises:
          APIError: 400 for invalid parameters or messages, 404 for an unknown model.
        """
        lora = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        tool_calls = await self._tool_calls(req)
        if (self.reasoning is not None and not self.constraints_after_reasoning
                and has_constraint(req)):
            raise APIError("structured outputs and required or named tool calls need the "
                           "engine built with the server's reasoning parser (`LLM(reasoning_"
                           "parser=...)`), or the constraint would apply to the reasoning too",
                           param=req.constraint_field)
        prompt = await self.chat_prompt(req.messages, req.add_generation_prompt,
                                        req.continue_final_message, req.tools,
                                        req.chat_template_kwargs)
        requested = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"

        def make_params(ids):
            return req.sampling_params(
                self._max_tokens(requested, len(ids), "messages", max_param), logprobs,
                defaults=self.defaults)

        streams = await self._add(request_id, [prompt], make_params, {
            "prompt": "messages", "logprobs": "top_logprobs", "max_tokens": max_param,
            "structured_outputs": req.constraint_field}, req.priority, lora)
        return streams, tool_calls

    def assistant_message(self, c: CompletionOutput,
                          tool_calls: Callable[[], ToolCallStream] | None
                          ) -> tuple[str | None, api.AssistantMessage, str | None]:
        """(reasoning, message, finish reason) of a finished completion: its thinking split off
        by the reasoning parser, its answer read for tool calls."""
        reasoning, answer = (None, c.text) if self.reasoning is None \
            else self.reasoning.split(c.text)
        message, finish_reason = answer_message(answer or "", c.finish_reason, tool_calls)
        message.reasoning_content = reasoning
        if reasoning is not None and answer is None and not message.tool_calls:
            message.content = None
        return reasoning, message, finish_reason

    async def _tool_calls(self, req: api.ChatCompletionRequest
                          ) -> Callable[[], ToolCallStream] | None:
        """What reads each choice's tool calls (None: plain text, no tools or "none"), after
        checking the tools: each function's parameters must compile as a JSON schema.

        Raises:
          APIError: 400 naming `tools` or `tool_choice`.
        """
        try:
            mode = req.tool_mode
        except InvalidRequestError as e:
            raise APIError(str(e), param=e.param) from e
        for i, (name, parameters) in enumerate(req.functions.items()):
            try:
                await self.engine.compile_constraint(
                    StructuredOutputsParams(json=parameters_schema(parameters)))
            except InvalidRequestError as e:
                raise APIError(f"tools[{i}] ({name}): the function's parameters are not a JSON "
                               f"schema this server can follow: {e}", param="tools") from e
        max_calls = None if req.parallel_tool_calls else 1
        if mode == "none":
            return None
        if mode == "auto":
            if self.tool_call_parser is None:
                raise APIError('tool_choice "auto" (the default with tools) needs the server '
                               'started with --enable-auto-tool-choice and --tool-call-parser; '
                               'or ask for "required", a named function, or "none"',
                               param="tool_choice")
            parser = TOOL_CALL_PARSERS[self.tool_call_parser]
            return lambda: ToolCallStream(parser(), max_calls)
        if mode == "required":
            return lambda: ToolCallStream(RequiredCalls(), max_calls)
        return lambda: ToolCallStream(NamedFunction(mode), 1)

    async def chat_prompt(self, messages: list[api.ChatMessage], add_generation_prompt: bool,
                          continue_final_message: bool, tools: list[api.ChatTool] | None = None,
                          template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """(text, ids) of the conversation (and the tools) under the chat template; 400 if it
        is rejected."""
        conversation = [template_message(i, m) for i, m in enumerate(messages)]
        tool_dicts = None if tools is None else [t.model_dump(exclude_none=True) for t in tools]
        try:
            return await self.engine.chat_prompt(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tool_dicts,
                template_kwargs=template_kwargs)
        except ValueError as e:
            raise APIError(str(e), param="messages") from e

    @staticmethod
    def _chat_logprobs(req, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None
                       ) -> api.ChatLogprobs | None:
        if not req.logprobs:
            return None
        return api.ChatLogprobs(content=chat_logprobs(token_ids, logprobs, req.top_logprobs or 0))

    def _chat_stream(self, req, request_id, streams, tool_calls) -> AsyncIterator[str]:
        created = int(time.time())
        readers: dict[int, ToolCallStream] = {}  # choice index -> its tool calls so far
        thinking: dict[int, ReasoningStream] = {}  # choice index -> its reasoning split

        def chunk(choices, usage=None):
            return sse(drop_none_deltas(api.ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, choices=choices,
                usage=usage)))

        def choice(c: CompletionOutput) -> api.ChatChunkChoice | None:
            text, reasoning = c.text, None
            if self.reasoning is not None:
                split = thinking.setdefault(c.index, self.reasoning.stream())
                reasoning, text = split.feed(c.text, final=c.finish_reason is not None)
                text = text or ""
            delta = api.DeltaMessage(content=text if reasoning is None else text or None,
                                     reasoning_content=reasoning)
            finish_reason = c.finish_reason
            if tool_calls is not None:
                reader = readers.setdefault(c.index, tool_calls())
                content, calls = reader.feed(text, final=c.finish_reason is not None)
                if not (content or calls or reasoning or c.finish_reason
                        or (req.logprobs and c.token_ids)):
                    return None  # held back: it may start a tool call
                delta = api.DeltaMessage(content=content or None, tool_calls=calls or None,
                                         reasoning_content=reasoning)
                finish_reason = reader.finish_reason(c.finish_reason)
            elif self.reasoning is not None and not (
                    text or reasoning or c.finish_reason or (req.logprobs and c.token_ids)):
                return None  # held back: it may start or end the reasoning
            return api.ChatChunkChoice(
                index=c.index, delta=delta, finish_reason=finish_reason,
                logprobs=self._chat_logprobs(req, c.token_ids, c.logprobs),
                stop_reason=c.stop_reason)

        def choices_of(_: int, output: RequestOutput, progress: Progress) -> list:
            return [x for c in output.outputs
                    if progress.advance(c.index, c, req.logprobs) is not None
                    and (x := choice(c)) is not None]

        roles = [api.ChatChunkChoice(index=j, delta=api.DeltaMessage(role="assistant",
                                                                      content=""))
                 for j in range(req.n)]
        return self._events(streams, chunk, choices_of, req.include_usage, roles)


def _split_prompts(prompt, param: str = "prompt") -> list[str | dict]:
    """The prompts of a completion (or embedding) request: one text or id list, or a list of
    them; 400 naming `param` when there is none."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(f"{param} is empty", param=param)
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


