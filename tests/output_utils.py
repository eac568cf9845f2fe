"""Comparing two engines' outputs of the same requests (the step-mode equality tests), and an
engine's state after its requests (the leak checks)."""

from __future__ import annotations

import numpy as np


def assert_same_outputs(outs, ref, atol: float = 1e-4) -> None:
    """`outs` and `ref` (lists of `RequestOutput`) hold the same completions: equal token ids,
    finish and stop reasons and text; cumulative logprobs and each reported token's logprobs
    within `atol`; prompt logprobs of the same length."""
    for o, r in zip(outs, ref, strict=True):
        assert len(o.outputs) == len(r.outputs)
        for c, rc in zip(o.outputs, r.outputs):
            assert c.token_ids == rc.token_ids
            assert (c.finish_reason, c.stop_reason, c.text) == (rc.finish_reason,
                                                                rc.stop_reason, rc.text)
            np.testing.assert_allclose(c.cumulative_logprob, rc.cumulative_logprob, atol=atol)
            assert (c.logprobs is None) == (rc.logprobs is None)
            for a, b in zip(c.logprobs or [], rc.logprobs or []):
                assert a.keys() == b.keys()
                np.testing.assert_allclose([x.logprob for x in a.values()],
                                           [x.logprob for x in b.values()], atol=atol)
        assert (o.prompt_logprobs is None
                or len(o.prompt_logprobs) == len(r.prompt_logprobs))


def assert_idle(llm) -> None:
    """`llm` (an `LLM`) holds no request and every KV block is free: nothing leaked."""
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_running"] == stats["num_waiting"] == 0, stats
