"""Which decoding sequences get proposals before a step, and how many."""

from __future__ import annotations

import logging

from collections.abc import Sequence as SequenceList

from jaxpaged.core.host_needs import SPECULATION, free_of
from jaxpaged.core.sequence import Sequence
from jaxpaged.config import SpeculativeConfig
from jaxpaged.spec_decode.registry import Proposer

logger = logging.getLogger(__name__)


def num_proposals(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many proposals `seq` may take: at most k, and leaving room for the token the target
    draws after them within `max_tokens` and `max_model_len`; 0 for a sequence whose outputs
    the proposals would change how they are computed (`host_needs.SPECULATION`: a grammar,
    penalties, min_tokens not reached, a scoring sequence)."""
    p = seq.params
    if not free_of(seq, SPECULATION):
        return 0
    room = min(p.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens) - 1
    return max(0, min(k, room))


def set_proposals(proposer: Proposer, config: SpeculativeConfig, running: SequenceList[Sequence],
                  num_waiting: int, max_model_len: int) -> None:
    """Sets `spec_token_ids` of each running sequence for the next step: none while a request
    waits (`num_waiting`) or a prompt is being computed (speculation steps aside under load,
    and steps that verify proposals only decode), or when more sequences decode than
    `config.disable_by_batch_size`; else what `proposer` proposes, up to `num_proposals`. A
    proposer that raises is logged, and the step decodes without proposals."""
    for seq in running:
        seq.spec_token_ids = []
    try:
        proposer.release(running)  # sequences preempted or aborted since the last step
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1
                    and s.num_output_tokens > 0]
        limit = config.disable_by_batch_size
        if (not decoding or len(decoding) < len(running) or num_waiting
                or (limit is not None and len(decoding) > limit)):
            return
        ks = [num_proposals(seq, config.num_speculative_tokens, max_model_len)
              for seq in decoding]
        proposals = proposer.propose(decoding, ks)
    except Exception:  # a failed proposal costs its speedup, not the requests
        logger.exception("speculative proposals failed; this step decodes without")
        return
    for seq, proposal in zip(decoding, proposals):
        seq.spec_token_ids = proposal
