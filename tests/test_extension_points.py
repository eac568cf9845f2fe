"""Extension points: a scheduling policy, a speculative proposer, an attention backend and a
quantization scheme are each one class and one registration line, written here outside the
package, and an engine runs with them."""

from __future__ import annotations

import pytest

from jaxpaged import SamplingParams
from jaxpaged.core.request_queue import REQUEST_QUEUES, RequestQueue
from jaxpaged.models.quantization import (QUANTIZATION_METHODS, Int8WeightOnly,
                                          QuantizedEmbed, QuantizedLinear)
from jaxpaged.pallas_kernels.backends import ATTENTION_BACKENDS, XlaBackend
from jaxpaged.spec_decode import PROPOSERS, register_proposer

PROMPTS = [{"prompt_token_ids": ids} for ids in ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16])]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


class LcfsQueue(RequestQueue):
    """Last come, first served: the newest waiting sequence is admitted next."""

    def add(self, seq):
        self._seqs.appendleft(seq)

    def add_preempted(self, seq):
        self._seqs.appendleft(seq)

    def block_victim(self, running, scheduled):
        return running[-1]


class LastTokenProposer:
    """Proposes the sequence's last token, k times."""

    def __init__(self, config, context):
        pass

    def propose(self, seqs, ks):
        return [[seq.token_ids[-1]] * k for seq, k in zip(seqs, ks)]

    def release(self, live):
        pass


class CountingXlaBackend(XlaBackend):
    """The xla backend, counting the layers it traces."""

    name = "counting-xla"
    traced = 0

    def _attention(self, *args, **kwargs):
        type(self).traced += 1
        return super()._attention(*args, **kwargs)


class Int8LinearOnly(Int8WeightOnly):
    """int8 linear layers; the embedding (and a tied LM head) stays float."""

    def embed(self, layer):
        return None


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(REQUEST_QUEUES, "lcfs", LcfsQueue)  # the one line: REQUEST_QUEUES[...] =
    monkeypatch.setitem(ATTENTION_BACKENDS, "counting-xla", CountingXlaBackend)  # one line
    monkeypatch.setitem(QUANTIZATION_METHODS, "int8-linear", Int8LinearOnly)  # one line
    register_proposer("last_token", LastTokenProposer)  # the one line
    yield
    del PROPOSERS["last_token"]


def _ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from jaxpaged import LLM

    llm = LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=256, precompile=False)
    return _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_a_registered_scheduling_policy_runs(registered, tiny_model_dir, make_llm, reference):
    llm = make_llm(tiny_model_dir, max_num_seqs=1, scheduling_policy="lcfs")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _ids(outs) == reference
    # one seat: the last prompt, added last, ran first and the first ran last
    assert outs[2].metrics.finished_time <= outs[1].metrics.first_scheduled_time
    assert outs[1].metrics.finished_time <= outs[0].metrics.first_scheduled_time


def test_an_unregistered_policy_names_the_registered_ones(registered):
    from jaxpaged.config import SchedulerConfig

    with pytest.raises(ValueError, match=r"one of \['fcfs', 'lcfs', 'priority'\], got 'lifo'"):
        SchedulerConfig(max_model_len=64, scheduling_policy="lifo")


def test_a_registered_proposer_runs(registered, tiny_model_dir, make_llm, reference):
    llm = make_llm(tiny_model_dir, speculative_config={"method": "last_token",
                                                       "num_speculative_tokens": 2})
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    stats = llm.stats()
    assert stats["num_spec_draft_tokens"] > 0, stats


def test_registering_a_method_twice_is_refused(registered):
    with pytest.raises(ValueError, match="'last_token' is registered already"):
        register_proposer("last_token", LastTokenProposer)


def test_a_registered_attention_backend_runs(registered, tiny_model_dir, make_llm, reference):
    # No compilation cache folder: a step compiled by an earlier run of this test would be
    # loaded from it, untraced.
    llm = make_llm(tiny_model_dir, attention_backend="counting-xla", compilation_cache_dir=None)
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert CountingXlaBackend.traced > 0


def test_a_registered_quantization_scheme_runs(registered, tiny_model_dir, make_llm):
    from flax import nnx

    from jaxpaged import LLM

    llm = make_llm(tiny_model_dir, quantization="int8-linear")
    runner = llm.llm_engine.runner
    kinds = {type(node) for _, node in nnx.iter_graph(nnx.merge(runner.graphdef, runner.params))}
    assert QuantizedLinear in kinds and QuantizedEmbed not in kinds, kinds
    ids = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert all(len(c[0]) == GREEDY.max_tokens for c in ids)
    with pytest.raises(ValueError, match="int8-linear"):
        LLM(tiny_model_dir, quantization="int4")
