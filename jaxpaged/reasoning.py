"""Reasoning parsers, one registry for the engine and the server (`LLM(reasoning_parser=NAME)`,
`jaxpaged serve --reasoning-parser NAME`): a reasoning model's thinking, written between
`<think>` and `</think>`, is returned apart from its answer as `reasoning_content` (vLLM's
field) in chat messages and stream deltas, and the engine holds structured outputs back until
it ends (`sample.structured_outputs.ReasoningGate`, which watches for the tags' token ids).

  qwen3        Qwen3: an output that opens with `<think>` reasons until `</think>`, then
               answers (never closed: all reasoning, cut off by its length); one that does
               not open with it is all answer (thinking was off).
  deepseek_r1  DeepSeek-R1: the template opens `<think>` in the prompt, so the output starts
               inside the reasoning; with no `</think>` it is all reasoning.

The rules follow vLLM's `Qwen3ReasoningParser` and `DeepSeekR1ReasoningParser`.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    """Splits a model's output into (reasoning, answer), whole or as a stream.

    A new parser is one subclass (or instance) and one line in `REASONING_PARSERS`."""

    def __init__(self, name: str, starts_inside: bool):
        self.name = name
        # Whether an output without `</think>` is reasoning (the prompt opened it) or answer.
        self.starts_inside = starts_inside

    def think_token_ids(self, tokenizer) -> tuple[int, int] | None:
        """(id of `<think>`, id of `</think>`) in `tokenizer`, or None where either tag is
        several tokens (the reasoning is then split from the text, and no gate can watch for
        it)."""
        ids = []
        for tag in (THINK_START, THINK_END):
            encoded = tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                return None
            ids.append(encoded[0])
        return ids[0], ids[1]

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a whole output; None for a part that is absent."""
        opened = text.lstrip().startswith(THINK_START)
        if not (opened or self.starts_inside):
            return None, text
        body = text.partition(THINK_START)[2] if opened else text
        if THINK_END not in body:
            return body, None
        reasoning, _, answer = body.partition(THINK_END)
        return reasoning, answer or None

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back in a stream)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One choice's stream: `feed(delta)` -> (reasoning delta, answer delta), holding back an
    end of the text that may be the start of a tag until the next delta (or `final`)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_answer = 0

    def _parts(self, final: bool) -> tuple[str, str]:
        text = self.text
        stripped = text.lstrip()
        if not final and THINK_START.startswith(stripped) and len(stripped) < len(THINK_START):
            return "", ""  # perhaps the opening tag
        opened = stripped.startswith(THINK_START)
        if not (opened or self.parser.starts_inside):
            return "", text  # qwen3 without an opening tag: the answer
        body = text.partition(THINK_START)[2] if opened else text
        if THINK_END in body:
            reasoning, _, answer = body.partition(THINK_END)
            return reasoning, answer
        hold = 0 if final else _partial_suffix(body, THINK_END)
        return body[:len(body) - hold], ""

    def feed(self, delta: str, final: bool = False) -> tuple[str | None, str | None]:
        self.text += delta
        reasoning, answer = self._parts(final)
        r, a = reasoning[self.sent_reasoning:], answer[self.sent_answer:]
        self.sent_reasoning += len(r)
        self.sent_answer += len(a)
        return r or None, a or None


REASONING_PARSERS = {"qwen3": lambda: ReasoningParser("qwen3", starts_inside=False),
                     "deepseek_r1": lambda: ReasoningParser("deepseek_r1", starts_inside=True)}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser called `name` (None: none).

    Raises:
      ValueError: an unknown name.
    """
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser {name!r} is not one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()
