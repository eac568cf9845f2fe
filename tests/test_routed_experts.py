"""`SamplingParams(return_routed_experts=True)`: each completion's `routed_experts` holds the
experts transformers' routers pick (`output_router_logits`) for the same tokens, at every MoE
layer, for every prompt and output token but the last, whichever way the engine computed them:
batched prompts, multi-step decoding and single steps, chunked prefill, prefix-cache hits,
n > 1 forks, preemption, speculative decoding, DELTA streaming; and a clear error on a model
without experts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.sampling_params import RequestOutputKind

torch = pytest.importorskip("torch")

PROMPTS = ["Hello there my friend, hello there", "1 2 3 4 5 6 7 8 9 10 1 2 3",
           "The quick brown fox jumps over the lazy dog and the quick brown fox"]
MAX_TOKENS = 10


def _moe_folder(path, tiny_model_dir, family: str):
    """A random 3-layer MoE model (8 experts, top-2) saved with `save_pretrained`, its routers'
    weights spread so that each token's k-th and (k+1)-th experts' logits lie apart."""
    import transformers

    from conftest import TINY_CONFIG, copy_tokenizer

    torch.manual_seed(0)
    config = {**TINY_CONFIG, "num_hidden_layers": 3}
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **config, num_local_experts=8, num_experts_per_tok=2))
    else:  # layer 1 dense: the routes list the MoE layers 0 and 2
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **config, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            moe_intermediate_size=TINY_CONFIG["intermediate_size"], mlp_only_layers=[1]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
    model.save_pretrained(path)
    copy_tokenizer(tiny_model_dir, path)
    return path, model.eval()


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_model(request, tmp_path_factory, tiny_model_dir):
    return _moe_folder(tmp_path_factory.mktemp(request.param), tiny_model_dir, request.param)


def hf_routes(model, token_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(i64[N - 1, L_moe, k] the experts HF's routers pick for all tokens but the last, in
    their order of weight; bool[N - 1, L_moe] where the k-th and (k+1)-th logits lie at least
    1e-3 apart, so that float rounding cannot swap them)."""
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(torch.tensor([token_ids[:-1]]), output_router_logits=True)
    logits = torch.stack([r.float() for r in out.router_logits], dim=1)  # [N-1, L, E]
    top = torch.topk(logits, k + 1, dim=-1)
    margin = (top.values[..., k - 1] - top.values[..., k]) >= 1e-3
    return top.indices[..., :k].numpy(), margin.numpy()


def check_routes(model, completion, prompt_ids: list[int]) -> None:
    tokens = list(prompt_ids) + list(completion.token_ids)
    routes = completion.routed_experts
    ref, clear = hf_routes(model, tokens)
    assert routes.dtype == np.int16 and routes.shape == ref.shape, (routes.shape, ref.shape)
    assert clear.mean() > 0.9  # the comparison below is not vacuous
    np.testing.assert_array_equal(routes[clear], ref[clear])


def generate(llm, params, prompts=PROMPTS):
    return llm.generate(prompts, params, use_tqdm=False)


def _one_family(request) -> None:
    """Skips a test whose check does not depend on the family (the request's validation, the
    server's field) on all families but the first."""
    if request.node.callspec.params["moe_model"] != "mixtral":
        pytest.skip("the same check as on mixtral")


@pytest.mark.parametrize("steps", [1, 8])
def test_routes_equal_the_hf_routers_picks(make_llm, moe_model, steps):
    """Greedy and seeded sampling, several prompts batched, multi-step decoding (8) and
    single steps (1)."""
    path, model = moe_model
    llm = make_llm(path, num_scheduler_steps=steps)
    for params in (SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                  return_routed_experts=True),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                                  ignore_eos=True, return_routed_experts=True)):
        for out in generate(llm, params):
            check_routes(model, out.outputs[0], out.prompt_token_ids)


def test_routes_through_chunks_prefix_hits_forks_and_preemption(make_llm, moe_model):
    """Prompts in chunks of 8 tokens, a second round served from the prefix cache, n = 3
    completions forked from one prefill (copy-on-write of their last block), and a pool small
    enough to preempt and recompute: every completion's routes are still HF's."""
    path, model = moe_model
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=MAX_TOKENS,
                            ignore_eos=True, return_routed_experts=True)
    # Both engines take steps of at most 8 tokens, so that they compile the same few sizes.
    chunked = make_llm(path, max_num_batched_tokens=8, enable_prefix_caching=True,
                       block_size=4)
    small = make_llm(path, block_size=4, num_kv_blocks=12, max_model_len=48, max_num_seqs=4,
                     max_num_batched_tokens=8)
    for llm, rounds in ((chunked, 2), (small, 1)):
        for round_ in range(rounds):
            outs = generate(llm, params)
            for out in outs:
                for completion in out.outputs:
                    check_routes(model, completion, out.prompt_token_ids)
            if round_ == 1:  # the second round: from the prefix cache
                assert all(out.num_cached_tokens >= 4 for out in outs)
    assert max(len(out.prompt_token_ids) for out in outs) > 8  # chunked
    assert small.stats()["num_preemptions"] > 0
    # A prompt that continues a forked completion: its cached blocks include the one the fork
    # copied on write, whose earlier tokens' routes were copied with its KV.
    first = generate(chunked, params, PROMPTS[:1])[0]
    assert len(first.prompt_token_ids) % 4  # the prompt's last block is shared, then copied
    longer = [{"prompt_token_ids": first.prompt_token_ids + c.token_ids}
              for c in first.outputs]
    for out in generate(chunked, dataclasses.replace(params, n=1), longer):
        assert out.num_cached_tokens >= len(first.prompt_token_ids) + 4
        check_routes(model, out.outputs[0], out.prompt_token_ids)


def test_routes_with_speculative_decoding_and_deltas(make_llm, moe_model):
    """An n-gram proposer verified by the MoE target (rejected proposals' routes are not
    reported), and DELTA outputs whose rows concatenate to the whole record."""
    path, model = moe_model
    llm = make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            return_routed_experts=True)
    for out in generate(llm, params):
        check_routes(model, out.outputs[0], out.prompt_token_ids)

    llm = make_llm(path, num_scheduler_steps=1)
    engine = llm.llm_engine
    delta = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                           return_routed_experts=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request(PROMPTS[0], delta, request_id="d")
    parts, ids, prompt_ids = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            parts.append(out.outputs[0].routed_experts)
            ids += out.outputs[0].token_ids
            prompt_ids = out.prompt_token_ids
    assert len(parts) == MAX_TOKENS
    whole = type("Completion", (), dict(token_ids=ids, routed_experts=np.concatenate(parts)))
    check_routes(model, whole, prompt_ids)


def test_routes_are_refused_on_a_model_without_experts_and_absent_unless_asked(
        make_llm, tiny_model_dir, moe_model, request):
    from jaxpaged.errors import InvalidRequestError

    _one_family(request)

    llm = make_llm(tiny_model_dir)
    with pytest.raises(InvalidRequestError, match="return_routed_experts") as e:
        llm.llm_engine.add_request("Hi", SamplingParams(return_routed_experts=True))
    assert e.value.param == "return_routed_experts"
    with pytest.raises(ValueError, match="return_routed_experts"):
        SamplingParams(return_routed_experts=1)
    out = generate(make_llm(moe_model[0]), SamplingParams(max_tokens=2), PROMPTS[:1])
    assert out[0].outputs[0].routed_experts is None


def test_the_server_returns_routes_as_its_extension_field(make_llm, moe_model, request):
    """`return_routed_experts` on /v1/completions and /v1/chat/completions: each choice's
    `routed_experts` equals `LLM.generate`'s for the same request; a stream asking for them
    is a 400 naming the field."""
    _one_family(request)
    import httpx
    from server_utils import ServerThread

    path, model = moe_model
    llm = make_llm(path, num_scheduler_steps=1)
    params = SamplingParams(temperature=0, max_tokens=6, return_routed_experts=True)
    [want] = generate(llm, params, PROMPTS[:1])
    body = {"model": "moe", "max_tokens": 6, "temperature": 0, "return_routed_experts": True}
    with ServerThread(llm, "moe") as server:
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": PROMPTS[0]},
                       timeout=60).json()
        [choice] = r["choices"]
        assert choice["routed_experts"] == want.outputs[0].routed_experts.tolist()
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            **body, "messages": [{"role": "user", "content": "Hi"}]}).json()
        routes = np.asarray(chat["choices"][0]["routed_experts"])
        assert routes.shape[1:] == want.outputs[0].routed_experts.shape[1:]
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={**body, "prompt": "Hi", "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_experts"


def test_a_recomputed_sequence_keeps_its_first_routes_and_outputs_are_read_only_views():
    """`RoutedExperts` on its own: a preempted sequence's recomputation (other ids) leaves the
    routes of its tokens as first written and fills only its last token's; a verifying step's
    rows past the last token are overwritten by the next; the output is a view no later step
    changes, and writing to it fails."""
    from jaxpaged.core.sequence import Sequence
    from jaxpaged.worker.routed_experts import RoutedExperts, routes_of

    store = RoutedExperts(num_blocks=4, block_size=4, num_layers=2, top_k=2)
    seq = Sequence("r", 0, list(range(6)), SamplingParams(return_routed_experts=True), seed=0)
    seq.block_table = [2, 0]
    step = lambda start, ids: store.record(
        [seq], np.array([start]), np.array([len(ids)]),
        np.array([[2, 0][p // 4] * 4 + p % 4 for p in range(start, start + len(ids))]),
        np.broadcast_to(np.asarray(ids, np.int16)[None, :, None], (2, len(ids), 2)))
    step(0, [1, 1, 1, 1, 1, 1])  # the prompt and a proposal past it: positions 0..5
    out = routes_of(seq)
    assert out.shape == (5, 2, 2) and (out == 1).all()
    step(0, [7, 7, 7, 7, 7, 7])  # recomputed after preemption: rows 0..4 stay, row 5 is new
    assert (routes_of(seq) == 1).all() and (seq.routed_experts[5] == 7).all()
    seq.token_ids.append(6)
    step(6, [3])
    assert routes_of(seq).shape == (6, 2, 2) and (routes_of(seq)[5] == 7).all()
    assert (out == 1).all() and out.shape == (5, 2, 2)  # the earlier view is unchanged
    with pytest.raises(ValueError, match="read-only"):
        out[0, 0, 0] = 2
    assert (store.slots[[8, 9, 10, 11, 0, 1]] == 7).all()  # the slots hold the latest
