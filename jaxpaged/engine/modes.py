"""What runs, decided once: the options as asked, resolved against each other and the model
into `config.EffectiveModes` while the `EngineConfig` is built (`EngineArgs.create_engine_config`).

Multi-step decoding (`num_scheduler_steps` > 1) draws greedily on the device with no proposer,
in steps whose positions all rotate alike: it is off under batch invariance (whose runner
draws on the host, one way whatever the batch), with speculative decoding, and for a model
whose RoPE switches with the sequence length (longrope recomputes a sequence). Async scheduling
runs in one process without a proposer. A mode asked for explicitly that cannot hold is logged
once, naming both options; one that differs only from its default is recorded with its reason.

The defaults of the options that depend on how the engine is used live in `EngineArgs`
(`DEFAULT_SCHEDULER_STEPS`, by `usage_context`).
"""

from __future__ import annotations

import logging

from jaxpaged.config import EffectiveModes, ResolvedMode, SpeculativeConfig

logger = logging.getLogger(__name__)

USAGE_CONTEXTS = ("serve", "offline")


def _steps_off_reason(batch_invariant: bool, speculative: SpeculativeConfig | None,
                      rope_switch_length: int | None) -> str | None:
    if batch_invariant:
        return "batch_invariant is set"
    if speculative is not None:
        return "speculative_config is set"
    if rope_switch_length:
        return ("the model's RoPE switches with the sequence length (longrope, at "
                f"{rope_switch_length} tokens)")
    return None


def _async_off_reason(speculative: SpeculativeConfig | None, num_processes: int) -> str | None:
    if speculative is not None:
        return "speculative_config is set"
    if num_processes > 1:
        return f"num_processes={num_processes} (async scheduling runs in one process)"
    return None


def resolve_modes(*, num_scheduler_steps: int | None, default_scheduler_steps: int,
                  async_scheduling: bool, batch_invariant: bool,
                  speculative: SpeculativeConfig | None, num_processes: int,
                  rope_switch_length: int | None) -> EffectiveModes:
    """The modes that will run (module doc), without the kernel plan (the platform's).

    Args:
      num_scheduler_steps: as asked (None: `default_scheduler_steps`, the usage context's
        default; 1 with async scheduling on).
      rope_switch_length: the model config's (`ModelConfig.rope_switch_length`).

    Speculative decoding itself is refused where it cannot run (a longrope model, tensor
    parallelism) when its proposer is built (`spec_decode.make_proposer`).
    """
    reason = _async_off_reason(speculative, num_processes) if async_scheduling else None
    if reason is not None:
        logger.warning("async_scheduling=True is off: %s", reason)
    async_mode = ResolvedMode(async_scheduling and reason is None, async_scheduling, reason)

    steps, reason = num_scheduler_steps, None
    if steps is None:
        steps = default_scheduler_steps
        if steps > 1 and async_mode.value:
            steps, reason = 1, "async_scheduling is on"
    if steps > 1:
        off = _steps_off_reason(batch_invariant, speculative, rope_switch_length)
        if off is not None:
            steps, reason = 1, off
            if num_scheduler_steps is not None:
                logger.warning("num_scheduler_steps=%d is off: %s", num_scheduler_steps, off)
    method = None if speculative is None else speculative.method
    return EffectiveModes(
        num_scheduler_steps=ResolvedMode(steps, num_scheduler_steps, reason),
        async_scheduling=async_mode,
        batch_invariant=ResolvedMode(batch_invariant, batch_invariant),
        speculative=ResolvedMode(method, method))
