"""Prompt logprobs and scoring: what a step computing logits at every token reads from them
(`ModelRunner.execute`): a prompt's per-token logprobs (vLLM's `prompt_logprobs`) and the
logprobs of a scoring request's completion tokens (`LLM.score`)."""

from __future__ import annotations

import jax
import numpy as np

from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.core.sequence import Sequence
from jaxpaged.sample import sampler
from jaxpaged.sample.sampler import num_candidates


def scored_tokens(out: SchedulerOutput, query_start_loc: np.ndarray
                  ) -> list[tuple[Sequence, int, int]]:
    """(seq, packed token index t, position p) of each token of the step whose logits score
    its scoring sequence's next token (p + 1 >= `Scoring.start`)."""
    scored = []
    for row, (seq, q) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
        if seq.scoring is None:
            continue
        first = seq.num_computed_tokens
        for p in range(max(first, seq.scoring.start - 1),
                       min(first + q, seq.num_prompt_tokens - 1)):
            scored.append((seq, int(query_start_loc[row]) + p - first, p))
    return scored

def score(logits: jax.Array, scored: list[tuple[Sequence, int, int]], vocab_size: int) -> None:
    """Fills the scoring sequences' `Scoring.logprobs` from the step's logits at every
    token f32[T, V] (`sampler.token_logprobs`)."""
    T = logits.shape[0]
    targets, top_k = np.zeros((T,), np.int32), np.zeros((T,), np.int32)
    temperature, top_p = np.ones((T,), np.float32), np.ones((T,), np.float32)
    for seq, t, p in scored:
        sc = seq.scoring
        targets[t] = seq.token_ids[p + 1]
        temperature[t], top_k[t], top_p[t] = sc.temperature, sc.top_k, sc.top_p
    C = num_candidates([s.scoring.top_k for s, _, _ in scored],
                       [s.scoring.top_p for s, _, _ in scored], vocab_size)
    values = jax.device_get(sampler.token_logprobs(logits, targets, temperature, top_k,
                                                   top_p, num_candidates=C))
    for seq, t, p in scored:
        seq.scoring.logprobs[p + 1 - seq.scoring.start] = values[t]

def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Whether this step computes the start of a prompt whose request asked for prompt
    logprobs (only a prompt's first chunk, never chunked, gets them)."""
    return (seq.num_computed_tokens == 0 and seq.params.prompt_logprobs is not None
            and seq.num_output_tokens == 0)

def collect_prompt_logprobs(out: SchedulerOutput, query_start_loc: np.ndarray,
                            rows: list[int], plp) -> dict:
    """{row: [(token logprob, rank, [(id, logprob)] top-k)] over prompt tokens 1..} from
    `sampler.prompt_logprobs`' arrays `plp` at every token of the step."""
    target_lp, ranks, top_ids, top_lp = plp
    collected = {}
    for row in rows:
        seq, q = out.seqs[row], out.num_scheduled_tokens[row]
        k = seq.params.prompt_logprobs
        tokens = range(query_start_loc[row],
                       query_start_loc[row] + min(q, seq.num_prompt_tokens) - 1)
        collected[row] = [
            (float(target_lp[t]), int(ranks[t]),
             list(zip(top_ids[t, :k].tolist(), top_lp[t, :k].tolist())) if k else [])
            for t in tokens]
    return collected
