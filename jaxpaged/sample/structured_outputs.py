"""Structured outputs: constraints on what a request may generate (a JSON schema, a regular
expression, a choice of strings, a Lark grammar), as vLLM's `StructuredOutputsParams`.

Grammars are compiled by llguidance (a Rust library with numpy-only wheels). Each constrained
sequence holds an `llguidance.LLMatcher`: before each draw it fills its row of the step's token
bitmask (`i32[R, ceil(V / 32)]`, bit t of word t // 32 set where token t is allowed), which the
jitted sampler applies (`sampler.sample`), and it advances on the token drawn
(`Scheduler.update_from_output`); once the grammar can take no more tokens the sequence
finishes with finish_reason "stop". With a reasoning parser (`LLM(reasoning_parser=...)`), the
constraint waits for the reasoning to end: a `ReasoningGate` lets every token through until the
model writes `</think>`, then the grammar applies to the answer (vLLM's behaviour). A compiled
grammar is cached by its source, so a schema sent again costs a copy of its matcher, and is
compiled where the request is validated, off the engine's step (the server does that on its
preprocessing threads).
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import llguidance
import llguidance.numpy
import numpy as np

from jaxpaged.errors import InvalidRequestError

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# Whitespace allowed between JSON tokens: room for a model's own pretty-printing, but bounded,
# since small models sampled at temperature 1 otherwise fill their whole budget with newlines
# (seen with SmolLM2-135M); a schema's own "x-guidance" settings take precedence.
JSON_DEFAULTS = {"whitespace_pattern": r"[ \t\n\r]{0,16}"}


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output; set exactly one field (vLLM's names).

    json: a JSON schema (a dict, or its JSON text) the output must meet.
    regex: a regular expression the whole output must match.
    choice: the output is exactly one of these strings.
    grammar: a Lark grammar (llguidance's dialect) the output must be a sentence of.
    json_object: any JSON object (`response_format={"type": "json_object"}`).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        given = self._given()
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs", f"structured_outputs takes exactly one of json, regex, "
                f"choice, grammar, json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError(
                "structured_outputs", f"structured_outputs.json must be a JSON schema (dict or "
                f"str), got {type(self.json).__name__}")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(
                "structured_outputs", f"structured_outputs.choice must be non-empty strings, "
                f"got {self.choice!r:.200}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError("structured_outputs",
                                          f"structured_outputs.{name} must be a str")

    def _given(self) -> list[str]:
        """The fields that are set."""
        return [f.name for f in dataclasses.fields(self)
                if getattr(self, f.name) not in (None, False)]

    @property
    def kind(self) -> str:
        """The field that is set ("json", "regex", ...), for error messages."""
        return self._given()[0]

    def grammar_source(self) -> str:
        """llguidance's grammar (its JSON form) for this constraint."""
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults=JSON_DEFAULTS)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.LLMatcher.grammar_from_regex(
                "|".join(f"({re.escape(c)})" for c in self.choice))
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe, with a cache by grammar source."""

    def __init__(self, tokenizer, vocab_size: int):
        """`tokenizer`: the model's HF tokenizer; `vocab_size`: V, the logits' width (it may
        exceed the tokenizer's)."""
        import llguidance.hf  # here, not at top: it imports much of transformers

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self._cache: dict[str, llguidance.LLMatcher] = {}
        self._lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `params`' grammar.

        Raises:
          InvalidRequestError: the schema, regex or grammar is invalid (llguidance's message,
            with the field named).
        """
        try:
            source = params.grammar_source()
        except Exception as e:  # a schema that is not JSON, or one llguidance cannot read
            raise InvalidRequestError("structured_outputs", f"structured_outputs.{params.kind} "
                                      f"is invalid: {e}") from e
        with self._lock:
            template = self._cache.pop(source, None)
        if template is None:
            error = llguidance.LLMatcher.validate_grammar(source, self.tokenizer)
            template = None if error else llguidance.LLMatcher(self.tokenizer, source)
            if error or template.is_error():
                raise InvalidRequestError(
                    "structured_outputs", f"structured_outputs.{params.kind} is invalid: "
                    f"{(error or template.get_error()).strip()[:500]}")
        with self._lock:
            self._cache[source] = template
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
        return template.deep_copy()


class ReasoningGate:
    """A request's grammar held back until its reasoning ends: every token is allowed until
    the `</think>` token, then `matcher` constrains the answer (vLLM's structured outputs skip
    the grammar the same way while `ReasoningParser.is_reasoning_end` is false). It answers the
    calls the engine makes on an `llguidance.LLMatcher`.

    Where the reasoning starts decides the first token: a prompt that already closed it (Qwen3's
    template with thinking off) is constrained from the first token; with `starts_inside`
    (DeepSeek-R1: the template opened `<think>`) the output is reasoning until `</think>`;
    otherwise (Qwen3) the first token is the grammar's or `<think>`, and an output that does
    not open with `<think>` is all answer, constrained from its first token."""

    def __init__(self, matcher: llguidance.LLMatcher, think_ids: tuple[int, int],
                 ended: bool, starts_inside: bool):
        self.matcher, self.think_ids = matcher, think_ids
        self.ended = ended
        self.first = not (ended or starts_inside)  # the first token decides (see above)

    @classmethod
    def for_prompt(cls, matcher, prompt_token_ids: list[int], think_ids: tuple[int, int],
                   starts_inside: bool) -> "ReasoningGate":
        """A gate for a request whose prompt is `prompt_token_ids`: the reasoning has ended
        already if the prompt's last `</think>` comes after its last `<think>`."""
        start, end = think_ids
        last = {t: i for i, t in enumerate(prompt_token_ids) if t in think_ids}
        return cls(matcher, think_ids, last.get(end, -1) > last.get(start, -1), starts_inside)

    def consume_token(self, token_id: int) -> bool:
        if self.first:
            self.first = False
            self.ended = token_id != self.think_ids[0]
        elif not self.ended:
            self.ended = token_id == self.think_ids[1]
            return True
        return self.matcher.consume_token(token_id) if self.ended else True

    def is_stopped(self) -> bool:
        return self.ended and self.matcher.is_stopped()

    def deep_copy(self) -> "ReasoningGate":
        copy = ReasoningGate(self.matcher.deep_copy(), self.think_ids, self.ended, True)
        copy.first = self.first
        return copy


def allocate_bitmask(num_rows: int, vocab_size: int):
    """i32[num_rows, ceil(V / 32)] with every token allowed."""
    bitmask = llguidance.numpy.allocate_token_bitmask(num_rows, vocab_size)
    bitmask[:] = -1
    return bitmask


def fill_bitmask(matcher: llguidance.LLMatcher, bitmask, row: int) -> None:
    """Writes the tokens `matcher` allows next into `bitmask[row]` (a gate still in the
    reasoning allows every token)."""
    if isinstance(matcher, ReasoningGate):
        if not (matcher.ended or matcher.first):
            bitmask[row] = -1
            return
        if matcher.first:  # the grammar's first tokens, or <think>
            llguidance.numpy.fill_next_token_bitmask(matcher.matcher, bitmask, row)
            start = matcher.think_ids[0]
            bitmask[row].view(np.uint32)[start // 32] |= np.uint32(1 << (start % 32))
            return
        matcher = matcher.matcher
    llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)
