"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Field names, defaults and ranges follow OpenAI's API reference for `/v1/completions` and
`/v1/chat/completions` (temperature in [0, 2], penalties in [-2, 2], ...), plus vLLM's extra
sampling fields (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, ...) and
structured outputs (`response_format`, vLLM's `structured_outputs` and its older `guided_*`).
Types are strict, as in OpenAI's schema: no string-to-number or number-to-bool coercion (`"4"`
is not an int, `true` not a number, `"yes"` not a bool), and numbers must be finite. A value
that fails validation gets a 400 naming the field. Unknown request fields are ignored, as
OpenAI's own API and vLLM do, and logged (`api_server.ignored_fields`).
"""

from __future__ import annotations

import functools

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from jaxpaged.errors import InvalidRequestError
from jaxpaged.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from jaxpaged.server.tool_calls import FUNCTION_NAME_PATTERN, tool_constraint
from jaxpaged.sample.structured_outputs import StructuredOutputsParams

TokenIds = list[Annotated[int, Field(ge=0)]]
# JSON object keys are strings: logit_bias's token ids are the one place a string becomes an int.
TokenIdKey = Annotated[int, Strict(False), Field(ge=0)]


class _Request(BaseModel):
    # Unknown fields are kept aside (`model_extra`) only to be logged; nothing reads them.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """Some clients send `null` for fields they leave unset: those take the default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Request):
    include_usage: bool = False  # one last chunk with empty `choices` and the usage


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` extra field (one of these set)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    priority: int = 0  # vLLM's: lower first, under `--scheduling-policy priority`
    # vLLM's extra sampling fields
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # jaxpaged's: each choice's `routed_experts` (Mixture-of-Experts models; not streamed)
    return_routed_experts: bool = False
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and vLLM's older
    # guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def constraint_field(self) -> str:
        """The field that sets the constraint, to name in errors."""
        names = ["structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "response_format"]
        return next((n for n in names if getattr(self, n) is not None), "structured_outputs")

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's structured-output constraint; raises InvalidRequestError naming the
        field when it is malformed or when several fields set one."""
        found = []
        if self.structured_outputs is not None:
            so = self.structured_outputs
            found.append(("structured_outputs", dict(json=so.json_, regex=so.regex,
                                                     choice=so.choice, grammar=so.grammar,
                                                     json_object=so.json_object)))
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, f"guided_{name}") is not None:
                found.append((f"guided_{name}", {name: getattr(self, f"guided_{name}")}))
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", dict(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise InvalidRequestError("response_format", "response_format of type "
                                          "json_schema needs a json_schema")
            found.append(("response_format", dict(json=fmt.json_schema.schema_)))
        if len(found) > 1:
            raise InvalidRequestError(found[1][0], f"set one structured output constraint, got "
                                      f"{[name for name, _ in found]}")
        if not found:
            return None
        name, kw = found[0]
        try:
            return StructuredOutputsParams(**kw)
        except InvalidRequestError as e:
            raise InvalidRequestError(name, str(e)) from e

    def sampling_value(self, name: str, defaults: dict):
        """The request's `name` field, or where the request leaves it out the model's default
        (`defaults`, from its generation config), or the field's own default."""
        if name in self.model_fields_set or name not in defaults:
            return getattr(self, name)
        return defaults[name]

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None, best_of: int | None = None,
                        defaults: dict | None = None) -> SamplingParams:
        """Deltas for a stream, the final output alone otherwise; the sampling fields the
        request leaves out from `defaults` (the model's generation config) where it has them;
        raises ValueError for combinations SamplingParams rejects, and for
        `return_routed_experts` in a stream."""
        if self.stream and self.return_routed_experts:
            raise InvalidRequestError("return_routed_experts", "return_routed_experts is not "
                                      "streamed: ask for it with stream false")
        value = functools.partial(self.sampling_value, defaults=defaults or {})
        return SamplingParams(
            n=self.n, best_of=best_of, temperature=value("temperature"), top_p=value("top_p"),
            top_k=value("top_k"), min_p=value("min_p"), presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=value("repetition_penalty"), seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=self.logit_bias, structured_outputs=self.constraint(),
            return_routed_experts=self.return_routed_experts,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt's logprobs alone
    best_of: int | None = Field(None, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None  # not supported: 400 if set


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers


class FunctionDefinition(_Request):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: extra variables for the chat template (`{"enable_thinking": false}` for Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def functions(self) -> dict[str, dict | None]:
        """The tools' functions: name -> parameters schema (None: no arguments)."""
        return {t.function.name: t.function.parameters for t in self.tools or []}

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required", or the named function's name; tools without
        `tool_choice` mean "auto", as in OpenAI's API.

        Raises:
          InvalidRequestError (param "tool_choice" or "tools"): a choice that needs tools
            without them, an unknown function, or two tools of one name.
        """
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise InvalidRequestError("tools", f"tools has two functions of one name: {names}")
        if choice is None:
            return "auto" if names else "none"
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise InvalidRequestError("tool_choice", f"tool_choice names function "
                                          f"{choice.function.name!r}, which is not in tools "
                                          f"{names}")
            return choice.function.name
        if choice != "none" and not names:
            raise InvalidRequestError("tool_choice", f"tool_choice {choice!r} needs tools")
        return choice

    def constraint(self) -> StructuredOutputsParams | None:
        """As for any request, or the one a required or named `tool_choice` implies (which
        excludes any other)."""
        tools = tool_constraint(self.functions, self.tool_mode, self.parallel_tool_calls)
        other = super().constraint()
        if tools is None:
            return other
        if other is not None:
            raise InvalidRequestError("tool_choice", f"tool_choice {self.tool_choice!r} "
                                      f"constrains the output; it excludes "
                                      f"{self.constraint_field}")
        return tools

    @property
    def constraint_field(self) -> str:
        if self.tool_choice not in (None, "none", "auto"):
            return "tools"
        return super().constraint_field


class TokenizeRequest(_Request):
    """`POST /tokenize`: `prompt` text, or `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # for the chat template, with messages
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class EmbeddingRequest(_Request):
    """`POST /v1/embeddings` (OpenAI's), with vLLM-style extras `pooling` and `normalize`."""

    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # accepted, unused
    pooling: Literal["last", "mean"] = "last"
    normalize: bool = True


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: float32 little-endian bytes


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: UsageInfo


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds


# -- responses -------------------------------------------------------------------------------

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionLogProbs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None  # vLLM: the stop token id or string that ended it
    # jaxpaged's extension (`return_routed_experts`): i16 [prompt and output tokens but the
    # last][MoE layer][k] expert ids, as `CompletionOutput.routed_experts`
    routed_experts: list[list[list[int]]] | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser (vLLM's field)
    tool_calls: list[ToolCall] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    routed_experts: list[list[list[int]]] | None = None  # as CompletionChoice's


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: `id`, `type` and the name come in its first piece only;
    the `arguments` pieces join into its JSON text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxpaged"
    root: str | None = None
    parent: str | None = None  # an adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
