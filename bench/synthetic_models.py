"""Hugging Face folders of real architectures at real sizes with random weights, for timing.

    python bench/synthetic_models.py qwen2-0.5b   # prints the folder ($JAXPAGED_HOME/bench-models/)

No hub is reachable here, so a model whose timing matters but whose weights do not is written
from its config: `config.json`, float32 `model.safetensors` (normal, std 0.02; norms 1) and the
default model's tokenizer (its ids all lie below these vocabularies).
"""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np

from jaxpaged.model_loader.model_store import ensure_default_model, jaxpaged_home, write_aside

# Qwen2.5-0.5B's shapes (Qwen2ForCausalLM): 24 layers, hidden 896, 14 query / 2 KV heads,
# intermediate 4864, vocabulary 151,936, tied embeddings, q/k/v biases.
CONFIGS = {
    "qwen2-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
        bos_token_id=1, eos_token_id=2, torch_dtype="float32", use_sliding_window=False),
    # A Mixture-of-Experts model of Qwen3-MoE's architecture at a size this machine runs
    # (Qwen3-30B-A3B's proportions scaled down: experts half as wide as the hidden size):
    # 12 layers, hidden 1024, 16 query / 4 KV heads of 64, 32 experts of intermediate 512,
    # top-4 renormalized; 685M parameters, 116M of them active per token.
    "qwen3-moe-0.7b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=1024,
        intermediate_size=2048, moe_intermediate_size=512, num_experts=32,
        num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        vocab_size=49152, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32", use_sliding_window=False),
}


def _weights(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights under the family's HF checkpoint names (Qwen2 or Qwen3-MoE)."""
    if config["model_type"] == "qwen3_moe":
        return _moe_weights(config, rng)
    D, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    H = D // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * H, config["num_key_value_heads"] * H

    def normal(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(V, D), "model.norm.weight": np.ones(D, np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": normal(q, D), p + "self_attn.q_proj.bias": normal(q),
              p + "self_attn.k_proj.weight": normal(kv, D), p + "self_attn.k_proj.bias": normal(kv),
              p + "self_attn.v_proj.weight": normal(kv, D), p + "self_attn.v_proj.bias": normal(kv),
              p + "self_attn.o_proj.weight": normal(D, q),
              p + "mlp.gate_proj.weight": normal(F, D), p + "mlp.up_proj.weight": normal(F, D),
              p + "mlp.down_proj.weight": normal(D, F),
              p + "input_layernorm.weight": np.ones(D, np.float32),
              p + "post_attention_layernorm.weight": np.ones(D, np.float32)}
    return w


def _moe_weights(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Qwen3-MoE's: q/k norms of one head's width, no biases, each expert's own matrices."""
    D, F, V = config["hidden_size"], config["moe_intermediate_size"], config["vocab_size"]
    H, E = config["head_dim"], config["num_experts"]
    q, kv = config["num_attention_heads"] * H, config["num_key_value_heads"] * H

    def normal(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(V, D), "model.norm.weight": np.ones(D, np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": normal(q, D),
              p + "self_attn.k_proj.weight": normal(kv, D),
              p + "self_attn.v_proj.weight": normal(kv, D),
              p + "self_attn.o_proj.weight": normal(D, q),
              p + "self_attn.q_norm.weight": np.ones(H, np.float32),
              p + "self_attn.k_norm.weight": np.ones(H, np.float32),
              p + "mlp.gate.weight": normal(E, D),
              p + "input_layernorm.weight": np.ones(D, np.float32),
              p + "post_attention_layernorm.weight": np.ones(D, np.float32)}
        for j in range(E):
            w |= {p + f"mlp.experts.{j}.gate_proj.weight": normal(F, D),
                  p + f"mlp.experts.{j}.up_proj.weight": normal(F, D),
                  p + f"mlp.experts.{j}.down_proj.weight": normal(D, F)}
    return w


def ensure(name: str):
    """The folder of synthetic model `name` (written once under $JAXPAGED_HOME/bench-models)."""
    from safetensors.numpy import save_file

    if name not in CONFIGS:
        raise ValueError(f"unknown synthetic model {name!r}; known: {sorted(CONFIGS)}")
    target = jaxpaged_home() / "bench-models" / name
    if target.is_dir():
        return target
    tokenizer_dir = ensure_default_model()

    def write(folder):
        config = CONFIGS[name]
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        save_file(_weights(config, np.random.default_rng(0)), folder / "model.safetensors")
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_dir / f).exists():
                shutil.copy(tokenizer_dir / f, folder / f)

    write_aside(target, write)
    return target


if __name__ == "__main__":
    print(ensure(sys.argv[1] if len(sys.argv) > 1 else "qwen2-0.5b"))
