"""Sampling parameters, with vLLM's names, defaults and ranges."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

from jaxpaged.errors import InvalidRequestError
from jaxpaged.engine.stop_strings import StopStrings
from jaxpaged.sample.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # most top log-probabilities a request may ask for per token (vLLM's default)
LOGPROBS_MODES = ("raw", "processed")
MAX_STOP_STRINGS = 64  # stop strings per request
MAX_STOP_STRING_CHARS = 256  # characters per stop string


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request holds (vLLM's names)."""

    CUMULATIVE = 0  # everything so far: text, token ids and logprobs from the first token
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # one output, when the request finishes (what `LLM.generate` uses)


@dataclasses.dataclass
class SamplingParams:
    """How to sample the completions of one prompt (vLLM's `SamplingParams`).

    Invalid values raise `InvalidRequestError` (a `ValueError`) naming the field and the value,
    when the object is built. Numbers must be finite. The stop strings are bounded
    (`MAX_STOP_STRINGS` of at most `MAX_STOP_STRING_CHARS` characters) and compiled into one
    automaton here, so that the engine checks them in time proportional to the new text.
    """

    n: int = 1  # completions returned per prompt
    best_of: int | None = None  # completions generated (>= n); the n most likely are returned
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # tokens kept; 0 or -1 means all
    min_p: float = 0.0  # drop tokens below min_p * p(most likely), in [0, 1]
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from each generated token
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0, HF semantics, over prompt and output tokens
    seed: int | None = None  # per-request seed: same seed, same tokens, whatever the batch
    stop: list[str] | None = None  # strings that end the completion (excluded from the text)
    stop_token_ids: list[int] | None = None  # token ids that end the completion (kept in ids)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False  # keep generating past the model's EOS token
    max_tokens: int | None = 16  # tokens generated at most; None means up to max_model_len
    min_tokens: int = 0  # EOS and stop tokens are masked until this many are generated
    logprobs: int | None = None  # top log-probabilities returned per output token (+ sampled)
    prompt_logprobs: int | None = None  # the same for prompt tokens
    # Which distribution `logprobs` report (vLLM's `logprobs_mode`): "raw", the model's
    # log-softmax; "processed", the one the token is drawn from, after logit bias, penalties,
    # temperature, min-p, top-k and top-p (-inf for tokens they remove).
    logprobs_mode: str = "raw"
    skip_special_tokens: bool = True  # leave special tokens out of the text
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    allowed_token_ids: list[int] | None = None  # if set, only these tokens can be sampled
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # A JSON schema, regex, choice or grammar the output must follow (`structured_outputs`).
    structured_outputs: StructuredOutputsParams | None = None
    # Mixture-of-Experts models: each completion's `routed_experts`, the experts every token
    # (prompt and output, all but the last) was routed to at each MoE layer, for routing
    # replay in RL training (`worker.routed_experts`).
    return_routed_experts: bool = False
    stop_strings: StopStrings | None = dataclasses.field(  # the automaton over `stop`
        default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        def bad(field: str, rule: str):
            raise InvalidRequestError(
                field, f"SamplingParams.{field} {rule}, got {getattr(self, field)!r:.200}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an int >= 1")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            bad("best_of", f"must be an int >= n={self.n} or None")
        if not _is_number(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an int: -1, 0 (both mean off) or >= 1")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        for field in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, field)) or not -2 <= getattr(self, field) <= 2:
                bad(field, "must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be a number > 0")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            bad("seed", "must be an int in [0, 2**64) or None")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a string or a list of non-empty strings")
        if (len(self.stop) > MAX_STOP_STRINGS
                or max(map(len, self.stop), default=0) > MAX_STOP_STRING_CHARS):
            bad("stop", f"must hold at most {MAX_STOP_STRINGS} strings of at most "
                f"{MAX_STOP_STRING_CHARS} characters")
        self.stop_strings = _stop_strings(tuple(self.stop)) if self.stop else None
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative ints")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an int >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be an int in [0, max_tokens={self.max_tokens}]")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                bad(field, f"must be an int in [0, {MAX_LOGPROBS}] or None")
        if self.logprobs_mode not in LOGPROBS_MODES:
            bad("logprobs_mode", f"must be one of {list(LOGPROBS_MODES)}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(k) and k >= 0 and _is_number(v) and -100 <= v <= 100
                    for k, v in self.logit_bias.items()):
                bad("logit_bias", "must map non-negative token ids to numbers in [-100, 100]")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or not all(
                    _is_int(t) and t >= 0 for t in self.allowed_token_ids):
                bad("allowed_token_ids", "must be a non-empty list of non-negative ints")
        for field in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                      "spaces_between_special_tokens", "return_routed_experts"):
            if not isinstance(getattr(self, field), bool):
                bad(field, "must be a bool")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", "must be a RequestOutputKind")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")
        # The n best of best_of completions are known only at the end, and their indices change
        # then, which deltas sent earlier cannot follow.
        if self.output_kind is RequestOutputKind.DELTA and self.best_of not in (None, self.n):
            bad("output_kind", f"DELTA needs best_of == n (got best_of={self.best_of}, "
                f"n={self.n})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        """Raises `InvalidRequestError` naming the first field with a token id past the vocab."""
        for field in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            bad = sorted({t for t in getattr(self, field) or () if t >= vocab_size})
            if bad:
                raise InvalidRequestError(field, f"SamplingParams.{field} names token ids "
                                          f"{bad[:8]}, not below vocab_size={vocab_size}")


@functools.lru_cache(maxsize=256)
def _stop_strings(stops: tuple[str, ...]) -> StopStrings:
    """One automaton per distinct stop list (a request of many prompts shares one); up to
    ~0.1 s to build for the largest list allowed."""
    return StopStrings(list(stops))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A finite int or float (not a bool, NaN or infinity)."""
    return _is_int(x) or (isinstance(x, float) and math.isfinite(x))


# generation_config.json's sampling fields that become defaults (vLLM's `--generation-config`),
# by their name there -> the SamplingParams / request field they set.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}


def generation_defaults(folder) -> dict:
    """The sampling defaults that `folder/generation_config.json` sets (vLLM's
    `--generation-config auto`: `temperature`, `top_p`, `top_k`, `min_p`,
    `repetition_penalty`, and `max_new_tokens` as `max_tokens`), by SamplingParams field; {}
    without the file. A request's own values override them.

    Raises:
      ValueError: the file is not a JSON object, or one of those values is not a number (the
        path and key named).
    """
    import json
    from pathlib import Path

    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    out = {}
    for key, field in GENERATION_CONFIG_FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        if not _is_number(value):
            raise ValueError(f"{path}: {key} must be a number, got {value!r}")
        out[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    return out
