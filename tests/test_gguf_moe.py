"""GGUF import of Mixture-of-Experts files: llama.cpp's Mixtral (a `llama` file with
`llama.expert_count`), Qwen2-MoE and Qwen3-MoE, their experts stacked by expert as
`convert_hf_to_gguf.py` stacks them (`blk.N.ffn_{gate,up,down}_exps.weight`, f[E, F, D] and
f[E, D, F]; llama's q/k permutation for Mixtral).

The imported folder holds the tensors `save_pretrained` wrote for the source model (one per
expert), loads in transformers as its GGUF loader loads the file where it reads the
architecture (Qwen2/3-MoE: not llama files with experts), and the engine's greedy ids from it,
and from the GGUF file served directly, equal those from the source folder and transformers'.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from conftest import copy_tokenizer  # noqa: E402
from jaxpaged import SamplingParams  # noqa: E402
from jaxpaged.model_loader.gguf_import import import_gguf  # noqa: E402
from test_gguf_import import N_BPE, write_gguf  # noqa: E402

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, vocab_size=N_BPE,
             tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
             pad_token_id=0)
# case -> (GGUF arch, HF model_type, MoE config fields)
CASES = {
    "mixtral": ("llama", "mixtral", dict(num_local_experts=8, num_experts_per_tok=2,
                                         rope_theta=10000.0)),
    "qwen3moe": ("qwen3moe", "qwen3_moe", dict(num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=48, head_dim=16,
                                               norm_topk_prob=True)),
    "qwen2moe": ("qwen2moe", "qwen2_moe", dict(num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=48,
                                               shared_expert_intermediate_size=80,
                                               norm_topk_prob=False)),
}
# One expert's tensor in HF checkpoints -> the merged name convert_hf_to_gguf.py stacks it under.
PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def stacked_tensors(hf_dir) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with each layer's experts stacked on a new first axis."""
    from safetensors.numpy import load_file

    out, experts = {}, {}
    for name, w in load_file(hf_dir / "model.safetensors").items():
        m = PER_EXPERT.match(name)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = w
        elif name.endswith("shared_expert_gate.weight"):
            out[name] = w.reshape(-1)  # f[D], as transformers' GGUF loader expects it
        else:
            out[name] = w
    for name, by_id in experts.items():
        out[name] = np.stack([by_id[j] for j in range(len(by_id))])
    return out


@pytest.fixture(scope="module", params=list(CASES))
def moe(request, tmp_path_factory):
    """(case, source transformers model, its save_pretrained folder, the GGUF's folder, the
    imported folder)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, model_type, fields = CASES[request.param]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **{**SHAPE, **fields})).eval()
    with torch.no_grad():  # random norms and biases; routers wide enough to route apart
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (1.0 if name.endswith("gate.weight") else 0.1))
    hf_dir, src = (tmp_path_factory.mktemp(f"{request.param}-{k}") for k in ("hf", "gguf"))
    model.save_pretrained(hf_dir)
    write_gguf(src / "model.gguf", arch, model, tokenizer="gpt2",
               tensors=stacked_tensors(hf_dir))
    out = tmp_path_factory.mktemp(f"{request.param}-imported")
    import_gguf(src / "model.gguf", out, progress=False)
    copy_tokenizer(out, hf_dir)
    return request.param, model, hf_dir, src, out


def test_tensors_equal_the_source_checkpoint_and_transformers_gguf_loading(moe):
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    case, _, hf_dir, src, out = moe
    ours, source = load_file(out / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert set(ours) == set(source)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in ours or case == "mixtral"
    for name, tensor in ours.items():
        assert tensor.dtype == np.float32, name
        np.testing.assert_array_equal(tensor, source[name], err_msg=name)
    if case == "mixtral":
        return  # transformers' GGUF loader reads a llama file as Llama, without experts
    # transformers' loader with our config (its own leaves moe_intermediate_size at the
    # config class's default, the released models' size)
    reference = AutoModelForCausalLM.from_pretrained(
        src, gguf_file="model.gguf", config=AutoConfig.from_pretrained(out),
        dtype=torch.float32).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(loaded) == set(reference)
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)


def test_engine_config_equals_the_source_folders(moe):
    from jaxpaged.models.registry import load_config

    case, model, hf_dir, _, out = moe
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    ours, want = load_config(out), load_config(hf_dir)
    assert ours.moe.num_experts == 8 and ours.moe.routing.top_k == 2
    for field in dataclasses.fields(ours):
        assert getattr(ours, field.name) == getattr(want, field.name), field.name


PROMPTS = [[5, 80, 200, 31, 7, 99, 150], [1, 100, 101, 102, 103, 104, 105, 106, 107, 108, 2, 40]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_greedy_ids_equal_the_source_folders_and_transformers(moe, make_llm, tmp_path,
                                                              monkeypatch):
    """The imported folder, the GGUF file served directly (float weights) and the source
    folder give transformers' greedy ids."""
    case, model, hf_dir, src, out = moe
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    monkeypatch.setenv("JAXPAGED_HOME", str(tmp_path))
    kw = dict(max_model_len=64, num_kv_blocks=32, compilation_cache_dir=None)
    for path, extra in ((hf_dir, {}), (out, {}), (str(src / "model.gguf"),
                                                  dict(quantization=None))):
        llm = make_llm(path, **kw, **extra)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, (case, path)


def _write_bad_mixtral(path, *, drop_key=None, expert_shape=None):
    """A 1-layer Mixtral-layout llama file with 4 experts, one key dropped or the gate
    experts' shape changed."""
    w = gguf.GGUFWriter(str(path), "llama")
    D, F, E = 8, 16, 4
    for key, add in (("block_count", w.add_block_count), ("embedding_length",
                     w.add_embedding_length), ("feed_forward_length", w.add_feed_forward_length),
                     ("head_count", w.add_head_count), ("expert_count", w.add_expert_count),
                     ("expert_used_count", w.add_expert_used_count)):
        if key != drop_key:
            add({"block_count": 1, "embedding_length": D, "feed_forward_length": F,
                 "head_count": 2, "expert_count": E, "expert_used_count": 2}[key])
    w.add_token_list(["a", "b", "c"])
    w.add_tokenizer_model("gpt2")
    w.add_token_merges([])
    for name, shape in (("ffn_gate_inp", (E, D)), ("ffn_gate_exps", expert_shape or (E, F, D)),
                        ("ffn_up_exps", (E, F, D)), ("ffn_down_exps", (E, D, F))):
        w.add_tensor(f"blk.0.{name}.weight", np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_malformed_moe_files_name_the_bad_value(tmp_path):
    _write_bad_mixtral(tmp_path / "count.gguf", drop_key="expert_count")
    with pytest.raises(ValueError, match="llama.expert_count is None"):
        import_gguf(tmp_path / "count.gguf", tmp_path / "out", progress=False)
    _write_bad_mixtral(tmp_path / "used.gguf", drop_key="expert_used_count")
    with pytest.raises(ValueError, match="llama.expert_used_count is None"):
        import_gguf(tmp_path / "used.gguf", tmp_path / "out", progress=False)
    _write_bad_mixtral(tmp_path / "shape.gguf", expert_shape=(3, 16, 8))
    with pytest.raises(ValueError, match=r"'blk.0.ffn_gate_exps.weight' has shape \(3, 16, 8\)"):
        import_gguf(tmp_path / "shape.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
