"""The `Proposer` protocol and the registry of proposers by `SpeculativeConfig.method`.

Adding a proposer is one file with a class that has `propose` and `release` (and is built as
`cls(config, context)`, or by a factory of that signature) and one line:
`register_proposer("name", MyProposer)`, or `register_proposer("name", "package.module:MyProposer")`
to import it only when an engine builds it (as the built-in ones are, so that importing
`jaxpaged.spec_decode` loads neither a draft model nor the worker);
`speculative_config={"method": "name", ...}` then picks it. The engine verifies whatever a proposer proposes (`sample.rejection_sampler`), so a
proposer changes how many tokens a step accepts, never which tokens come out.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from jaxpaged.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jaxpaged.core.sequence import Sequence


class Proposer(Protocol):
    """Guesses the next tokens of decoding sequences before a step."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """At most `ks[i]` proposed token ids after each of `seqs` (their `token_ids` as they
        are: the step computes their last token); a row may get fewer, or none."""

    def release(self, live: Iterable[Sequence]) -> None:
        """Drops what is kept for sequences not in `live` (finished, preempted, aborted)."""


@dataclasses.dataclass(frozen=True)
class ProposerContext:
    """What the engine gives a proposer's factory about the target and its limits."""

    model_config: Any  # the target's `ModelConfig`
    dtype: Any  # the target's weight jnp dtype
    attention_backend: Any  # the target's attention backend object
    cache_config: CacheConfig
    num_blocks: int  # blocks in the target's KV pool
    scheduler_config: SchedulerConfig
    compilation_cache_dir: Any = None  # the target runner's executable cache folder (or None)
    mesh: Any = None  # the target's device mesh (None: one device)


ProposerFactory = Callable[[SpeculativeConfig, ProposerContext], Proposer]

# `SpeculativeConfig.method` -> the factory of its proposer, or its "module:name" path,
# imported on first use (`proposer_factory`).
PROPOSERS: dict[str, ProposerFactory | str] = {
    "ngram": "jaxpaged.spec_decode.ngram:NgramProposer",
    "draft_model": "jaxpaged.spec_decode.draft_model:build_draft_model_proposer",
}


def register_proposer(method: str, factory: ProposerFactory | str) -> None:
    """Makes `speculative_config={"method": method}` build its proposer with `factory`: a
    callable, or its "module:name" path, imported when an engine first builds it.

    Raises:
      ValueError: `method` is registered already, or a path without its ":name".
    """
    if method in PROPOSERS:
        raise ValueError(f"speculative method {method!r} is registered already")
    if isinstance(factory, str) and ":" not in factory:
        raise ValueError(f"proposer path {factory!r} must be 'module:name'")
    PROPOSERS[method] = factory


def proposer_factory(method: str) -> ProposerFactory:
    """The factory registered for `method`, its module imported where it was given by path.

    Raises:
      KeyError: `method` is not registered.
    """
    factory = PROPOSERS[method]
    if isinstance(factory, str):
        module, _, name = factory.partition(":")
        factory = PROPOSERS[method] = getattr(importlib.import_module(module), name)
    return factory


def make_proposer(config: SpeculativeConfig, context: ProposerContext) -> Proposer:
    """The proposer of `config.method`.

    Raises:
      ValueError: a combination speculative decoding does not support (named), or what the
        method's factory refuses (a draft model with another vocabulary).
    """
    if context.model_config.rope_switch_length:
        raise ValueError("speculative_config: not supported for a model whose RoPE switches "
                         "with the sequence length (longrope)")
    if context.mesh is not None:
        raise ValueError("speculative_config: not supported with tensor_parallel_size > 1")
    return proposer_factory(config.method)(config, context)
