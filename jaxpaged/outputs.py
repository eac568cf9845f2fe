"""What `LLM.generate` returns, shaped as vLLM's `RequestOutput` and `CompletionOutput`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int  # which of the request's n completions
    text: str  # detokenized output, special tokens skipped per SamplingParams
    token_ids: list[int]  # generated ids, including a final EOS or stop token
    finish_reason: str | None = None  # "stop" (EOS or stop token), "length", or None if running
    stop_reason: int | None = None  # the stop token id when a stop_token_ids entry ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions so far."""

    request_id: str
    prompt: str | None  # None when the request was given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
