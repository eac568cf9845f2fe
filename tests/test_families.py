"""Every registered family against `transformers` (float32, tiny random configs saved with
`save_pretrained`): greedy ids equal `generate(do_sample=False)` on prompts longer than the
sliding window, through one-shot prefill (on the platform's backend), chunked prefill, prefix-cache hits,
preemption and batching with other prompts (on the cpu, xla and pallas-interpret backends);
last-token logits within 1e-4 of the HF model's, and the dense forward's (no pool) at every
position.

Each attention backend receives a layer's window, soft cap and scale as arguments; which layers
have a window, and the scale, come from the family's config before attention. The cpu backend
(xla where the C++ kernel cannot be built) runs every family. The xla backend runs the two
Gemmas: a window on alternate layers with soft caps (Gemma 2), a window on one layer of two
without caps (Gemma 3: as Mistral's window and Qwen2's per-layer one reach the backend); the
interpreted Pallas kernels (seconds a run) run Gemma 2, whose layers take both a window and a
cap (tests/test_kernels.py checks the kernels against their reference over head and block
sizes, groups, dtypes, windows and caps, and an engine on them against xla). The others' own
parts (Phi-3's partial rotary and longrope, the experts, q/k norms and clamps, Granite's
multipliers) act before or after attention, where every backend runs the same code (Granite's
attention multiplier is the scale, as Gemma's), and are checked on the cpu backend."""

import shutil

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from conftest import TINY_CONFIG, copy_tokenizer
from jaxpaged import SamplingParams
from test_parity import prefill_logits

WINDOW = 16
COMMON = dict(TINY_CONFIG, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "mistral": (transformers.MistralConfig, dict(sliding_window=WINDOW, head_dim=16)),
    "qwen2": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=1)),
    "gemma2": (transformers.Gemma2Config, dict(
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=10.0, final_logit_softcapping=5.0, tie_word_embeddings=True)),
    "gemma3": (transformers.Gemma3TextConfig, dict(
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"])),
    "phi3": (transformers.Phi3Config, dict(partial_rotary_factor=0.5, sliding_window=WINDOW)),
    # Mistral's attention, a Mixture-of-Experts MLP (8 experts, top-2) in every layer
    "mixtral": (transformers.MixtralConfig, dict(sliding_window=WINDOW, head_dim=16,
                                                 num_local_experts=8, num_experts_per_tok=2)),
    # a shared expert, no renormalization, layer 1 dense (mlp_only_layers)
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[1])),
    # renormalized, every second layer sparse (decoder_sparse_step: layer 0 dense)
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, decoder_sparse_step=2)),
    # full-width q/k norms, q/k/v clamped, no renormalization
    "olmoe": (transformers.OlmoeConfig, dict(num_experts=8, num_experts_per_tok=2,
                                             clip_qkv=2.0, norm_topk_prob=False)),
    # top-k of the logits then softmax; the four multipliers away from 1
    "granitemoe": (transformers.GraniteMoeConfig, dict(
        num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=3.0,
        attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0)),
    # longrope with a 32-token original length: the longer prompts rotate with the long
    # factors from their first token, the shorter ones switch while decoding past it.
    "phi3-longrope": (transformers.Phi3Config, dict(
        partial_rotary_factor=0.5, original_max_position_embeddings=32,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                             partial_rotary_factor=0.5, short_factor=[1.0, 1.1, 1.3, 1.7],
                             long_factor=[1.5, 2.5, 4.0, 7.0]))),
}
HF_CLASSES = {"gemma3": transformers.Gemma3ForCausalLM}
# See the module docstring; the MoE families' attention is Mistral's, Qwen2's and Qwen3's, their
# experts act after it.
SAME_ATTENTION_AS_LLAMA = ("phi3", "phi3-longrope", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                           "granitemoe")
# Prompts of 3 to 60 tokens: most are longer than the window. The last repeats the one before's
# start, for a prefix-cache hit.
PROMPTS = [
    "Hi there",
    "Write a haiku about paged attention and the memory it saves, then explain each line.",
    "List three prime numbers greater than one hundred and explain how you checked each of "
    "them, one by one, with the division tests you used.",
    "In 1969, the first humans walked on the Moon. Describe the mission in detail, including "
    "the crew, the spacecraft, the landing site and what they brought back to Earth for study.",
    "In 1969, the first humans walked on the Moon. Describe the mission in detail, including "
    "the crew and the rocket.",
]
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, tiny_model_dir):
    """(name, model dir, HF model, HF greedy ids per prompt) of a tiny random checkpoint."""
    name = request.param
    config_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = config_cls(**{**COMMON, **extra})
    model = (HF_CLASSES[name](config) if name in HF_CLASSES
             else AutoModelForCausalLM.from_config(config)).eval()
    with torch.no_grad():  # random norm weights, so that a norm applied wrong shows
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(-0.5, 0.5) if name.startswith("gemma") else p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp(f"tiny-{name}")
    model.save_pretrained(path)
    copy_tokenizer(tiny_model_dir, path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    assert max(map(len, ids)) > 2 * WINDOW
    want = []
    with torch.no_grad():
        for p in ids:
            out = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    return name, path, model, ids, want


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


# The families each non-default backend runs (see the module docstring).
XLA_FAMILIES = ("gemma2", "gemma3")
PALLAS_FAMILIES = ("gemma2",)


def _skip_backend(name, backend):
    """Skips the backends a family is not run on (see the module docstring)."""
    from jaxpaged.pallas_kernels import cpu_attention

    if backend == "cpu" and not cpu_attention.available():
        pytest.skip("no C++ compiler")
    if name in SAME_ATTENTION_AS_LLAMA and backend != (
            "cpu" if cpu_attention.available() else "xla"):
        pytest.skip("attention as llama's: checked on one backend")
    if backend == "xla" and name not in XLA_FAMILIES and cpu_attention.available():
        pytest.skip("xla's windows, with and without soft caps, are checked on the Gemmas")
    if backend == "pallas-interpret" and name not in PALLAS_FAMILIES:
        pytest.skip("the interpreted Pallas kernels run on Gemma 2's windows and caps")


def test_one_shot_prefill(make_llm, family):
    # Every prompt in one step (a 2,048-token budget, a roomy pool, no prefix shared first), on
    # the platform's backend, for the families whose attention differs; every family runs the
    # chunked, cached and preempted case below, and the one-shot logits tests.
    name, path, _, ids, want = family
    if name in SAME_ATTENTION_AS_LLAMA and name != "phi3-longrope":  # longrope's recompute
        pytest.skip("attention as llama's: one-shot prefill checked on llama's kin")
    backend = "auto"
    llm = make_llm(path, max_model_len=128, enable_prefix_caching=False,
                   attention_backend=backend)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want, name
    # longrope recomputes (as a preemption) the prompts that decode past its original length
    crossing = sum(len(p) <= 32 < len(p) + MAX_NEW_TOKENS - 1 for p in ids)
    assert llm.stats()["num_preemptions"] == (crossing if name == "phi3-longrope" else 0)


def test_last_token_logits(family):
    name, path, model, ids, _ = family
    ours = prefill_logits(path, ids)
    for b, p in enumerate(ids):
        with torch.no_grad():
            ref = model(torch.tensor([p])).logits[0, -1].numpy()
        assert np.abs(ours[b] - ref).max() / np.abs(ref).max() < 1e-4, (name, b)


def test_dense_forward_logits(family):
    """The dense forward (no pool; `LLM.dense_forward`) on a padded batch: at every real
    position within 1e-4 of the HF model's logits (windows, soft caps, longrope included)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpaged.models import dense_forward, load_config, load_model

    name, path, model, ids, _ = family
    graphdef, params = nnx.split(load_model(path, load_config(path), jnp.float32))
    rows = [ids[1], ids[3]]  # one short, one past the window (and longrope's switch)
    T = max(map(len, rows))
    tokens, mask = np.zeros((2, T), np.int32), np.zeros((2, T), bool)
    tokens[0, T - len(rows[0]):], mask[0, T - len(rows[0]):] = rows[0], True  # left-padded
    tokens[1, :len(rows[1])], mask[1, :len(rows[1])] = rows[1], True
    logits = np.asarray(jax.jit(dense_forward, static_argnums=0)(graphdef, params, tokens, mask))
    for b, row in enumerate(rows):
        with torch.no_grad():
            ref = model(torch.tensor([row])).logits[0].numpy()
        ours = logits[b][mask[b]]
        assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4, (name, b)


@pytest.mark.parametrize("backend", ["cpu", "xla", "pallas-interpret"])
def test_chunked_cached_preempted_batched(make_llm, family, backend):
    # A 24-token budget chunks the longer prompts; the last prompt finds the one before's
    # blocks in the prefix cache; 14 blocks of 8 tokens cannot hold all five sequences, so
    # some are preempted and recomputed.
    name, path, _, ids, want = family
    _skip_backend(name, backend)
    llm = make_llm(path, max_model_len=64, block_size=8, num_kv_blocks=14,
                   max_num_batched_tokens=24, attention_backend=backend)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want, name
    assert max(map(len, ids)) > 24  # chunked
    if name != "phi3-longrope":  # which turns prefix caching off
        assert outs[-1].num_cached_tokens > 0  # a prefix-cache hit
    assert llm.stats()["num_preemptions"] > 0


def test_the_window_and_soft_caps_change_these_logits(family, tmp_path):
    # Not a test that cannot fail: without its window (and Gemma 2 without its soft-caps) the
    # same checkpoint's last-token logits on the longest prompt are far from transformers'.
    import json

    name, path, model, ids, _ = family
    config = json.loads((path / "config.json").read_text())
    if config.get("use_sliding_window") is False:  # its sliding_window is not used (Qwen)
        del config["sliding_window"]
    changed = {k: None for k in ("sliding_window", "attn_logit_softcapping",
                                 "final_logit_softcapping") if config.get(k) is not None}
    if not changed:
        pytest.skip(f"{name} has no window or soft-cap")
    shutil.copytree(path, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, **changed}))
    longest = max(ids, key=len)
    with torch.no_grad():
        ref = model(torch.tensor([longest])).logits[0, -1].numpy()
    ours = prefill_logits(tmp_path / "m", [longest])[0]
    assert np.abs(ours - ref).max() / np.abs(ref).max() > 1e-3


def test_unsupported_architectures_and_fields_are_named(family, tmp_path):
    import json

    from jaxpaged.models import SUPPORTED_ARCHITECTURES, load_config

    name, path, *_ = family
    config = json.loads((path / "config.json").read_text())
    shutil.copytree(path, tmp_path / "m")
    cases = [(dict(architectures=["FalconForCausalLM"]), "FalconForCausalLM.*Gemma3ForCausalLM"),
             ({"hidden_act": "relu", "hidden_activation": "relu"}, "'relu'"),
             (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), "'dynamic'")]
    if config.get("use_sliding_window") is not False:  # else layer types are not read (Qwen)
        cases.append((dict(layer_types=["full_attention"]), "layer_types"))
    for change, message in cases:
        (tmp_path / "m" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            load_config(tmp_path / "m")
    assert {"MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
            "Gemma3ForCausalLM", "Phi3ForCausalLM"} <= set(SUPPORTED_ARCHITECTURES)
