"""`LLMEngine.stats()`: block, queue, token and speculation counts of one engine, and the
modes it runs in."""

from __future__ import annotations

from jaxpaged.models.quantization import weight_bytes


def engine_stats(engine) -> dict:
    """Block and queue counts: num_total_blocks, num_free_blocks, num_used_blocks,
    num_shared_blocks, num_cow_copies, num_running, num_waiting (sequences),
    num_running_requests, num_waiting_requests (requests with a running sequence / with all
    sequences waiting), and the running totals num_preemptions, num_prompt_tokens,
    num_generation_tokens, num_failed_requests (failed by a fault in a step),
    num_prefix_cache_queries / num_prefix_cache_hits (full prompt blocks looked up in / found in
    the prefix cache); num_compilations (shapes the model step is compiled for); weight_bytes
    (the parameters' bytes, whole arrays) and kv_cache_bytes_per_token (pool bytes per token,
    all layers); with speculative decoding, num_spec_drafts, num_spec_draft_tokens,
    num_spec_accepted_tokens (steps a sequence verified proposals in, tokens proposed, tokens
    accepted) and spec_acceptance_rate; and effective_modes, the modes that run with what
    was asked and why they differ (`config.EffectiveModes.to_dict`)."""
    bm, scheduler, runner = engine.block_manager, engine.scheduler, engine.runner
    running_requests = {s.request_id for s in scheduler.running}
    waiting_requests = {s.request_id for s in scheduler.waiting} - running_requests
    stats = {
        "num_total_blocks": bm.num_blocks,
        "num_free_blocks": bm.num_free_blocks,
        "num_used_blocks": bm.num_blocks - bm.num_free_blocks,
        "num_shared_blocks": bm.num_shared_blocks,
        "num_cow_copies": bm.num_cow_copies,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "num_running_requests": len(running_requests),
        "num_waiting_requests": len(waiting_requests),
        "num_preemptions": scheduler.num_preemptions,
        "num_prefix_cache_queries": bm.num_cache_queries,
        "num_prefix_cache_hits": bm.num_cache_hits,
        "num_prompt_tokens": engine.book.num_prompt_tokens,
        "num_generation_tokens": engine.output_processor.num_generation_tokens,
        "num_failed_requests": engine.book.num_failed_requests,
        "num_compilations": runner.num_compilations,
        "weight_bytes": 0 if runner.params is None else weight_bytes(runner.params),
        "kv_cache_bytes_per_token": runner.kv_cache.spec.bytes_per_token,
        "effective_modes": engine.config.modes.to_dict(),
    }
    if engine.proposer is not None:
        stats.update({
            "num_spec_drafts": scheduler.num_spec_drafts,
            "num_spec_draft_tokens": scheduler.num_spec_draft_tokens,
            "num_spec_accepted_tokens": scheduler.num_spec_accepted_tokens,
            "spec_acceptance_rate": (scheduler.num_spec_accepted_tokens
                                     / max(1, scheduler.num_spec_draft_tokens)),
        })
    return stats
