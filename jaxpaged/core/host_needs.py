"""What a request needs from the host between two of its draws: the one answer that every
mode's eligibility reads.

A draw can be made on the device alone when it is the argmax of the raw logits and its next
input is that draw. Several modes rest on that: the step's own greedy draws in place of a
sampler call (`worker.draws`), k decode steps in one call (`num_scheduler_steps`), a step
launched before the last one's draws are read (`async_scheduling`), and speculative
proposals, which are verified against draws that must not depend on the proposals' own
effect on the host's state. Each asks `host_needs(seq)` and tests the flags it cannot
serve. (The sampler's own metadata, `InputBatch`, still reads each parameter it applies.)
"""

from __future__ import annotations

import enum

from jaxpaged.core.sequence import Sequence


class HostNeed(enum.Flag):
    """Why a sequence's next draw needs the host (flags; `HostNeed(0)`: nothing)."""

    SAMPLER = enum.auto()  # not the argmax of raw logits: temperature, bias, allowed tokens
    LOGPROBS = enum.auto()  # its draws report logprobs (top-k, or a processed distribution)
    MIN_TOKENS = enum.auto()  # stop tokens masked until `min_tokens` outputs
    OUTPUTS = enum.auto()  # reads its earlier outputs: penalties, a grammar's matcher
    PROMPT_LOGITS = enum.auto()  # logits at every prompt token: prompt logprobs (until the
    # first output), scoring
    PROPOSALS = enum.auto()  # speculative proposals to verify this step


# A draw the model step makes itself (`sampler.greedy_draw`): none of these.
ON_DEVICE_DRAW = (HostNeed.SAMPLER | HostNeed.LOGPROBS | HostNeed.MIN_TOKENS | HostNeed.OUTPUTS
                  | HostNeed.PROMPT_LOGITS)
# Several decode steps in one call: draws on the device, no proposals.
MULTI_STEP = ON_DEVICE_DRAW | HostNeed.PROPOSALS
# A step launched before the last draw is known: only what reads earlier outputs or computes
# prompt logits needs that draw first (logprobs, bias and the sampler run on the device).
ASYNC_OVERLAP = HostNeed.OUTPUTS | HostNeed.PROMPT_LOGITS
# Proposals change the sequence before the target draws: not where draws read earlier outputs,
# mask stop tokens by count, or score the prompt.
SPECULATION = HostNeed.OUTPUTS | HostNeed.PROMPT_LOGITS | HostNeed.MIN_TOKENS


def host_needs(seq: Sequence) -> HostNeed:
    """What `seq`'s next draw needs from the host (see `HostNeed`), from its sampling
    parameters and its state now (`min_tokens` counts its outputs; proposals are this step's).
    """
    p, need = seq.params, HostNeed(0)
    if (not p.is_greedy or p.logit_bias or p.allowed_token_ids is not None):
        need |= HostNeed.SAMPLER
    if p.logprobs is not None or p.logprobs_mode != "raw":
        need |= HostNeed.LOGPROBS
    if seq.num_output_tokens < p.min_tokens:
        need |= HostNeed.MIN_TOKENS
    if (seq.matcher is not None or p.structured_outputs is not None
            or p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty):
        need |= HostNeed.OUTPUTS
    # Prompt logprobs come from the step that computes the prompt, before the first output
    # (`worker.prompt_logprobs.wants_prompt_logprobs`); a scoring sequence's from every chunk.
    if seq.scoring is not None or (p.prompt_logprobs is not None
                                   and seq.num_output_tokens == 0):
        need |= HostNeed.PROMPT_LOGITS
    if seq.spec_token_ids:
        need |= HostNeed.PROPOSALS
    return need


def free_of(seq: Sequence, needs: HostNeed) -> bool:
    """Whether `seq` needs none of `needs` (`host_needs`): e.g. `free_of(seq, MULTI_STEP)`."""
    return not host_needs(seq) & needs
