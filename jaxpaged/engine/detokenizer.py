"""Incremental detokenization: each new token's text, without re-decoding the whole output.

Two offsets into the token list mark a short window: text already emitted ends at `read_offset`,
and decoding starts a few tokens earlier, at `prefix_offset`, so that tokenizers whose text depends
on the previous token (leading-space handling, byte-level merges) decode the new token in context.
A delta that ends in U+FFFD is an incomplete multi-byte character and is held back until the bytes
that complete it arrive.

A fast tokenizer (a `tokenizers.Tokenizer` behind it) that does no clean-up of spaces runs the
same algorithm in Rust instead (`tokenizers.decoders.DecodeStream`, which vLLM's fast
detokenizer uses too): a token costs about a microsecond, not five. A prompt whose text ends
inside a multi-byte character keeps the Python algorithm (see `__init__`).

The output's text is vLLM's: `decode(prompt + output)` from the length (in characters) of
`decode(prompt)` on, so a character that the prompt starts and the output completes, which
`decode(prompt)` shows as U+FFFD, is the prompt's.
"""

from __future__ import annotations

import tokenizers
from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for context


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        # A prompt that ends inside a character (its text ends in U+FFFD): the Rust stream,
        # primed with such ids, emits the prompt's text again with the character's first
        # delta, so such prompts take the Python window, whose prefix text holds the U+FFFD.
        if (isinstance(backend, tokenizers.Tokenizer)
                and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
                and not self._decode(self.token_ids).endswith("\ufffd")):
            self._backend = backend
            self._stream = DecodeStream(ids=self.token_ids,
                                        skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Appends one token; returns the text it completes (possibly empty)."""
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id) or ""
            self.text += delta
            return delta
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
