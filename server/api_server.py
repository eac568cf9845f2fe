"""The OpenAI-compatible HTTP server: a Starlette app around an `AsyncLLMEngine`.

    jaxpaged serve [--model M] [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/embeddings`,
`POST /v1/responses` with `GET`/`DELETE /v1/responses/{id}` (`responses`), `GET /v1/models`,
`GET /v1/models/{id}`, `GET /health`,
`GET /version`, `GET /metrics`, `POST /tokenize`, `POST /detokenize`, and with
`allow_runtime_lora_updating` `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(`server.lora`; a request's `model` may name a LoRA adapter). Errors carry OpenAI's body
`{"error": {"message", "type", "param", "code"}}`: 400 for invalid input (`param` names the
field), 401 for a missing or wrong API key on `/v1/*`, 404 for an unknown model or route, 415
for a body not sent as `application/json`, 500 for a request that a fault in an engine step
failed (the others go on), 501 for an operation the engine refuses by name (a
NotImplementedError: on several processes, see `jaxpaged.distributed.multihost`), 503 once a
fatal fault has stopped the engine; `serve` then exits with status 1 (see `jaxpaged.errors`).
A client that disconnects while sending its body gets one log line, not an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

import pydantic
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

import jaxpaged
from jaxpaged.engine.async_llm_engine import AsyncLLMEngine
from jaxpaged.server import protocol as api
from jaxpaged.server.metrics import ServerMetrics
from jaxpaged.server.responses import ResponsesServing
from jaxpaged.server.responses_protocol import ResponsesRequest
from jaxpaged.server.errors import APIError, parse_body
from jaxpaged.server.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from jaxpaged.server.serving import OpenAIServing

logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
              model_root: str | None = None, tool_call_parser: str | None = None,
              generation_defaults: dict | None = None,
              allow_runtime_lora_updating: bool = False) -> Starlette:
    """The app serving `engine` as model `model_name`; `/v1/*` needs `api_key` if one is set;
    `tool_call_parser` (a name in `tool_calls.TOOL_CALL_PARSERS`) allows `tool_choice="auto"`;
    `generation_defaults` (`LLM.generation_defaults`) fill the sampling fields a request leaves
    out; the engine's reasoning parser (`LLM(reasoning_parser=...)`) returns chats' thinking as
    `reasoning_content`; `allow_runtime_lora_updating` adds the routes that load and unload
    LoRA adapters (vLLM keeps them behind a flag too).

    The engine's step loop starts and stops with the app (its lifespan).
    """
    metrics = ServerMetrics(engine, model_name)
    serving = OpenAIServing(engine, model_name, on_finished=metrics.observe_finished,
                            tool_call_parser=tool_call_parser,
                            generation_defaults=generation_defaults)
    h = _Handlers(engine, model_name, model_root, serving, metrics)
    routes = [
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/chat/completions", h.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", h.embeddings, methods=["POST"]),
        Route("/v1/responses", h.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", h.stored_response, methods=["GET", "DELETE"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/v1/models/{model:path}", h.model, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/version", h.version, methods=["GET"]),
        Route("/metrics", h.prometheus, methods=["GET"]),
        Route("/tokenize", h.tokenize, methods=["POST"]),
        Route("/detokenize", h.detokenize, methods=["POST"]),
        *([Route("/v1/load_lora_adapter", h.load_lora_adapter, methods=["POST"]),
           Route("/v1/unload_lora_adapter", h.unload_lora_adapter, methods=["POST"])]
          if allow_runtime_lora_updating else []),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        yield
        await engine.shutdown()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        APIError: lambda request, e: _error(e),
        ClientDisconnect: _client_disconnected,
        HTTPException: lambda request, e: _error(APIError(
            e.detail, e.status_code, code="not_found" if e.status_code == 404 else None)),
        # An operation this engine refuses (on several processes, say), named in the message.
        NotImplementedError: lambda request, e: _error(APIError(
            str(e), 501, type="not_implemented_error")),
        Exception: _internal_error,
    })
    if api_key is not None:
        app.add_middleware(_BearerAuth, api_key=api_key)
    return app


class _Handlers:
    """The routes' handlers for one served model."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, model_root: str | None,
                 serving: OpenAIServing, metrics: ServerMetrics):
        self.engine, self.model_name, self.model_root = engine, model_name, model_root
        self.serving, self.metrics = serving, metrics
        self.responses = ResponsesServing(serving)

    async def create_response(self, request: Request) -> Response:
        req = await _parse(request, ResponsesRequest)
        return await _respond(request, self.responses.create(req))

    async def stored_response(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            return JSONResponse(self.responses.delete(response_id))
        return JSONResponse(self.responses.get(response_id).model_dump(mode="json"))

    async def completions(self, request: Request) -> Response:
        req = await _parse(request, api.CompletionRequest)
        return await _respond(request, self.serving.create_completion(req))

    async def chat_completions(self, request: Request) -> Response:
        req = await _parse(request, api.ChatCompletionRequest)
        return await _respond(request, self.serving.create_chat_completion(req))

    async def embeddings(self, request: Request) -> Response:
        req = await _parse(request, api.EmbeddingRequest)
        return await _respond(request, self.serving.create_embedding(req))

    def _cards(self) -> list[api.ModelCard]:
        return [api.ModelCard(id=self.model_name, root=self.model_root,
                              max_model_len=self.engine.max_model_len),
                *self.serving.lora.cards()]

    async def models(self, request: Request) -> Response:
        return JSONResponse(api.ModelList(data=self._cards()).model_dump())

    async def model(self, request: Request) -> Response:
        model = request.path_params["model"]
        card = next((c for c in self._cards() if c.id == model), None)
        if card is None:
            return _error(APIError(f"The model `{model}` does not exist.", 404, "model",
                                   "model_not_found"))
        return JSONResponse(card.model_dump())

    async def load_lora_adapter(self, request: Request) -> Response:
        req = await _parse(request, LoadLoRAAdapterRequest)
        return PlainTextResponse(await self.serving.lora.load(req))

    async def unload_lora_adapter(self, request: Request) -> Response:
        req = await _parse(request, UnloadLoRAAdapterRequest)
        return PlainTextResponse(await self.serving.lora.unload(req))

    async def health(self, request: Request) -> Response:
        if self.engine.dead is not None:
            return _error(APIError("the engine stopped on a fatal fault; restart the server",
                                   503, type="server_error"))
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": jaxpaged.__version__})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, request: Request) -> Response:
        req = await _parse(request, api.TokenizeRequest)
        self.serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            _, ids = await self.serving.chat_prompt(req.messages, req.add_generation_prompt,
                                                    req.continue_final_message, req.tools)
        else:
            ids = await self.engine.tokenize(req.prompt, req.add_special_tokens)
        return JSONResponse(api.TokenizeResponse(
            count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids).model_dump())

    async def detokenize(self, request: Request) -> Response:
        req = await _parse(request, api.DetokenizeRequest)
        self.serving.check_model(req.model)
        vocab_size = self.engine.vocab_size
        bad = [t for t in req.tokens if t >= vocab_size]
        if bad:
            raise APIError(f"tokens {bad[:8]} are not ids in [0, {vocab_size})", param="tokens")
        return JSONResponse(api.DetokenizeResponse(
            prompt=await self.engine.decode(req.tokens)).model_dump())


async def _parse(request: Request, model: type[pydantic.BaseModel]):
    """The JSON body as `model`: 415 unless sent as JSON, 400 naming the first bad field (the
    top-level field in `param`, its full path in the message). Unknown fields are logged."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise APIError(f"the body must be JSON sent with 'Content-Type: application/json', got "
                       f"{content_type or 'no content type'!r}", 415)
    parsed = parse_body(model, await request.body())
    ignored = ignored_fields(parsed)
    if ignored:  # the names are the client's: quoted, and at most 10 of them
        logger.warning("%s %s: ignored %d unknown field(s): %s", request.method,
                       request.url.path, len(ignored), ", ".join(map(repr, ignored[:10])))
    return parsed


async def _respond(request: Request, handler) -> Response:
    """Runs a handler; streams its SSE iterator or sends its JSON. A client that disconnects
    before a non-streamed response is ready cancels the handler (aborting its requests)."""
    result = await _cancel_on_disconnect(request, handler)
    if isinstance(result, pydantic.BaseModel):
        return JSONResponse(result.model_dump(mode="json"))
    # StreamingResponse cancels the iterator when the client disconnects.
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _cancel_on_disconnect(request: Request, coro):
    work = asyncio.ensure_future(coro)

    async def wait_for_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        raise APIError("the client disconnected", 499)
    return work.result()


class _BearerAuth:
    """ASGI middleware: `/v1/*` needs `Authorization: Bearer <api_key>`, else 401."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error(APIError("Incorrect or missing API key: send "
                                           "'Authorization: Bearer <key>'", 401,
                                           code="invalid_api_key"))
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _client_disconnected(request: Request, e: ClientDisconnect) -> Response:
    """The client left while sending its body: one log line; the response goes nowhere."""
    logger.info("%s %s: the client disconnected while sending its body", request.method,
                request.url.path)
    return Response(status_code=499)


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return _error(APIError(f"internal server error: {e!r}", 500, type="server_error"))


def run_server(llm: jaxpaged.LLM, model_name: str, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, model_root: str | None = None,
               log_level: str = "info", tool_call_parser: str | None = None,
               chat_template: str | None = None, allow_runtime_lora_updating: bool = False
               ) -> int:
    """Serves `llm`'s engine with uvicorn until interrupted (returns 0), or until a fatal fault
    stops the engine or the server cannot start, say on a port in use (returns 1: the exit
    status of `jaxpaged serve`, for a supervisor). `tool_call_parser`: see `build_app`;
    `chat_template`: a Jinja chat template (the text) in place of the tokenizer's; the model's
    generation-config defaults (`llm.generation_defaults`) fill what requests leave out."""
    import uvicorn

    _log_like_uvicorn(log_level)
    if chat_template is not None:
        llm.get_tokenizer().chat_template = chat_template
    engine = AsyncLLMEngine(llm.llm_engine)
    app = build_app(engine, model_name, api_key, model_root, tool_call_parser,
                    getattr(llm, "generation_defaults", None), allow_runtime_lora_updating)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    engine.on_dead(lambda: setattr(server, "should_exit", True))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        pass
    if not server.started:
        return 1
    if engine.dead is not None:
        logger.error("exiting: the engine stopped on a fatal fault (%s)", engine.dead)
        return 1
    return 0


def _log_like_uvicorn(log_level: str) -> None:
    """jaxpaged's log lines on stderr beside uvicorn's, at the same level."""
    root = logging.getLogger("jaxpaged")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(log_level.upper())


def ignored_fields(request: pydantic.BaseModel, path: str = "") -> list[str]:
    """Dotted paths of the unknown fields anywhere in a parsed request (they were ignored)."""
    found = [f"{path}{name}" for name in request.model_extra or {}]
    for name in type(request).model_fields:
        value = getattr(request, name)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, pydantic.BaseModel):
                index = f".{i}" if isinstance(value, list) else ""
                found += ignored_fields(item, f"{path}{name}{index}.")
    return found
