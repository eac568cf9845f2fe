"""What `LLM.generate` returns, shaped as vLLM's `RequestOutput` and `CompletionOutput`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclasses.dataclass
class Logprob:
    """A token's log-probability under the raw model distribution (before sampling transforms)."""

    logprob: float
    rank: int | None = None  # 1-based rank in the vocabulary
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int  # which of the request's n completions
    text: str  # detokenized output, special tokens skipped per SamplingParams
    token_ids: list[int]  # generated ids, including a final EOS or stop token
    cumulative_logprob: float | None = None  # sum of the sampled tokens' log-probabilities
    logprobs: list[dict[int, Logprob]] | None = None  # per token: top-k and the sampled token
    # "stop" (EOS, stop token or string), "length", "abort", "error" (a step fault failed the
    # request: `RequestOutput.error` says which), or None while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # `SamplingParams.return_routed_experts`: numpy i16[N - 1, L_moe, k], the k experts (most
    # likely first) each of the completion's N prompt and output tokens but the last was routed
    # to at each of the model's L_moe MoE layers, in layer order (vLLM's field); with
    # `RequestOutputKind.DELTA`, the rows added since the last output. None otherwise.
    routed_experts: "np.ndarray | None" = None

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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [None, then per token]
    metrics: "RequestMetrics | None" = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # the fault that failed the request (finish_reason "error")


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (seconds, `time.time()`) of a request's milestones, and its length."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0  # tokens generated so far (the longest completion's)
    # Speculative decoding (`jaxpaged.spec_decode`), over the request's completions: steps
    # that verified proposals, tokens proposed, and tokens of those accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed tokens; None when nothing was proposed."""
        return (self.spec_num_accepted_tokens / self.spec_num_draft_tokens
                if self.spec_num_draft_tokens else None)

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens a verifying step produced on average: 1 + accepted per draft (vLLM's mean
        acceptance length); None when nothing was proposed."""
        return (1 + self.spec_num_accepted_tokens / self.spec_num_drafts
                if self.spec_num_drafts else None)


@dataclasses.dataclass
class EmbeddingOutput:
    """One prompt's embedding (`LLM.embed`): f32[D] as a list, pooled hidden states."""

    embedding: list[float]


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """vLLM's `EmbeddingRequestOutput`: a prompt's embedding and its token ids."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
