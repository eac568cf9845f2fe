"""Speculative decoding: proposals for each decoding sequence, verified in one packed step.

Before a step, a proposer (`registry.Proposer`, picked by `SpeculativeConfig.method` from
`registry.PROPOSERS`) guesses the next k tokens of each decoding sequence
(`proposals.set_proposals`). `ngram.NgramProposer`: the tokens that followed the latest earlier
occurrence of the sequence's last n-gram, vLLM's prompt lookup; `draft_model.DraftModelProposer`:
k greedy steps of a smaller model with its own KV pool and block tables. The scheduler gives such
a sequence 1 + k query tokens (its last token and the proposals) in the step's packed batch; the
runner samples the target at each of those positions as it samples any decode
(`ModelRunner.execute`), and keeps the proposals up to the first one that differs from the
target's own draw, plus that draw (`sample.rejection_sampler`, which says why this keeps the
target's distribution). So greedy outputs equal decoding without speculation, and a seeded
request draws the same tokens with or without speculation (up to the float rounding of a step
of k + 1 tokens against one).

The rejected proposals' KV slots are overwritten by later tokens, and blocks past the
sequence's tokens go back to the block manager after the step (`BlockManager.trim`).

Adding a proposer: one file with its class, one `register_proposer` line (`registry`).
Proposers are registered by name and imported when an engine builds one, so importing this
package (or `SpeculativeConfig`, which lives in `jaxpaged.config`) loads no draft model and
no worker; the draft model's names below are imported on first use.
"""

import importlib

from jaxpaged.config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from jaxpaged.spec_decode.registry import (PROPOSERS, Proposer, ProposerContext, make_proposer,
                                           proposer_factory, register_proposer)
from jaxpaged.spec_decode.ngram import NgramProposer, ngram_proposal
from jaxpaged.spec_decode.proposals import num_proposals, set_proposals

_LAZY = {"DraftModelProposer": "jaxpaged.spec_decode.draft_model",
         "build_draft_model_proposer": "jaxpaged.spec_decode.draft_model"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'jaxpaged.spec_decode' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = ["DEFAULT_DISABLE_BY_BATCH_SIZE", "PROPOSERS", "DraftModelProposer", "NgramProposer",
           "Proposer", "ProposerContext", "SpeculativeConfig", "build_draft_model_proposer",
           "make_proposer", "ngram_proposal", "num_proposals", "proposer_factory",
           "register_proposer",
           "set_proposals"]
