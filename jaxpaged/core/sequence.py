"""A sequence: one completion being generated, with its tokens, blocks and progress."""

from __future__ import annotations

import dataclasses
import enum
import itertools

import numpy as np

from jaxpaged.sampling_params import SamplingParams


# A drawn token whose value the host does not know yet (async scheduling books a step before its
# draws come back: `core.async_booking`); the next step reads it on the device.
PLACEHOLDER = -1


def completion_seed(seed: int, index: int) -> int:
    """Seed of a request's completion `index`: seed + index (vLLM's convention for n > 1)."""
    return (seed + index) % 2**64


@dataclasses.dataclass
class Scoring:
    """What a scoring sequence (`LLM.completion_logprobs`) computes: the log-probability of each
    of its tokens from `start` on given the ones before it, under `temperature` / `top_k` /
    `top_p` as the sampler applies them. The runner fills `logprobs` (f32[num_tokens - start])
    as the steps compute the positions before them."""

    start: int
    temperature: float
    top_k: int
    top_p: float
    logprobs: np.ndarray


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens of one completion (prompt first), its block table and its finish state.

    `num_computed_tokens` counts the tokens whose K/V are in the pool. A step computes the rest:
    all of them in a prefill, one in a decode. Preemption by recompute frees the blocks and sets
    it back to 0, so the next prefill recomputes prompt and output alike and the output is kept.
    """

    _ids = itertools.count()

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.params = params
        self.seed = seed  # the sampler's key for output token t is fold_in(key(seed), t)
        self.num_forks = 0  # children still to fork from this sequence after its prefill
        # Prefix caching: chained hashes of full blocks, how many of its blocks are registered
        # in the cache, and the prompt tokens found cached at its first allocation.
        self.block_hashes: list[int] = []
        self.num_registered_blocks = 0
        self.cache_epoch = 0  # `BlockManager.cache_epoch` when its blocks were allocated
        self.num_cached_tokens: int | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        # Structured outputs: the grammar's state after this sequence's output tokens
        # (`llguidance.LLMatcher`), None when the request has no constraint.
        self.matcher = None
        # `SamplingParams.return_routed_experts`: i16[capacity, L_moe, k] the expert ids of
        # its first `num_routed` positions (`worker.routed_experts`), else None.
        self.routed_experts = None
        self.num_routed = 0
        # `LLM.completion_logprobs`: the tokens from this index on are scored, not generated.
        self.scoring: Scoring | None = None
        # Speculative decoding (`jaxpaged.spec_decode`): the proposals of the step being built,
        # and the running counts of proposing steps, tokens proposed and tokens accepted.
        self.spec_token_ids: list[int] = []
        # Priority scheduling: the request's priority (lower first) and arrival order.
        self.priority = 0
        self.arrival = 0
        # LoRA: the adapter version it runs under (`lora.manager.LoadedLoRA`, None: the base
        # model) and its device slot while admitted (0: none).
        self.lora = None
        self.lora_slot = 0
        # Async scheduling: its last token is drawn but not known yet and is its last by
        # length (max_tokens, max_model_len), so no step computes it (`core.async_booking`).
        self.length_capped = False
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def cache_key(self):
        """What its prefix-cache hashes start from besides its tokens: its adapter version's
        uid, so that blocks computed under another adapter (or none) never match."""
        return None if self.lora is None else ("lora", self.lora.uid)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, index: int, seed: int) -> "Sequence":
        """A child with the same tokens and progress; blocks are shared by the block manager."""
        child = Sequence(self.request_id, index, self.token_ids[:self.num_prompt_tokens],
                         self.params, seed)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.priority, child.arrival = self.priority, self.arrival
        child.lora, child.lora_slot = self.lora, self.lora_slot
        child.matcher = None if self.matcher is None else self.matcher.deep_copy()
        if self.routed_experts is not None:
            child.routed_experts = self.routed_experts.copy()
            child.num_routed = self.num_routed
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
