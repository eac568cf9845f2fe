"""Import of a llama-architecture GGUF file into a standard Hugging Face model folder.

Everything is read with the `gguf` package and written with public `transformers` / `tokenizers`
/ `safetensors` APIs, so importing needs no torch (transformers' own GGUF loader imports torch):
- config.json: `transformers.LlamaConfig` built from the `llama.*` metadata keys;
- tokenizer: a byte-level BPE `tokenizers.Tokenizer` from `tokenizer.ggml.*` (vocabulary, merges,
  control tokens as special tokens) and the file's chat template; it encodes exactly as
  transformers' GGUF tokenizer conversion does (checked in tests/test_model_store.py);
- model.safetensors: tensors dequantized to float32 and renamed to HF names through
  `gguf.TensorNameMap`; q/k projections are un-permuted from llama.cpp's interleaved RoPE layout
  back to HF's rotate-half layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxpaged.models.llama import LLAMA_NAME_MAP

_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType values


def read_metadata(reader) -> dict:
    """All key/value metadata of a `gguf.GGUFReader` as Python values."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def hf_config(meta: dict, tied: bool):
    """A `transformers.LlamaConfig` from GGUF metadata. Raises ValueError for other archs."""
    from transformers import LlamaConfig

    if meta.get("general.architecture") != "llama":
        raise ValueError(f"GGUF architecture {meta.get('general.architecture')!r} is not "
                         "supported; only 'llama'")
    n_heads = meta["llama.attention.head_count"]
    hidden = meta["llama.embedding_length"]
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=n_heads,
        num_key_value_heads=meta.get("llama.attention.head_count_kv", n_heads),
        head_dim=meta.get("llama.attention.key_length", hidden // n_heads),
        max_position_embeddings=meta["llama.context_length"],
        # GGUF stores eps as float32 (1e-5 becomes 9.9999997e-06); HF configs carry the decimal.
        rms_norm_eps=float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.6g}"),
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0))},
        tie_word_embeddings=tied,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


def hf_tokenizer(meta: dict):
    """A `PreTrainedTokenizerFast` for a byte-level BPE ("gpt2") GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} is not "
                         "supported; only byte-level BPE ('gpt2')")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _USER_DEFINED])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return None if i is None else tokens[i]

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"), unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"), chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)))


def hf_tensors(reader, num_layers: int, num_heads: int, num_kv_heads: int,
               progress: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of the file, dequantized to float32 and keyed by its HF name."""
    import gguf
    from tqdm import tqdm

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, num_layers)
    hf_names = {}
    for hf_pattern, *_ in LLAMA_NAME_MAP:
        for i in range(num_layers) if "{i}" in hf_pattern else [None]:
            hf_name = hf_pattern.format(i=i)
            gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight",))
            if gguf_name is not None:
                hf_names[gguf_name] = hf_name
    heads = {".self_attn.q_proj.": num_heads, ".self_attn.k_proj.": num_kv_heads}
    tensors = {}
    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=not progress):
        if t.name not in hf_names:
            raise ValueError(f"GGUF tensor {t.name!r} has no Hugging Face name")
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        for proj, n in heads.items():
            if proj in hf_names[t.name]:  # undo llama.cpp's row permutation for its RoPE
                w = w.reshape(n, -1, 2, w.shape[-1]).swapaxes(1, 2).reshape(-1, w.shape[-1])
        tensors[hf_names[t.name]] = np.ascontiguousarray(w)
    return tensors


def import_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Writes config, generation config, tokenizer and float32 safetensors into `out_dir`.

    Raises:
      ValueError: the file's architecture or tokenizer model is not supported.
    """
    import gguf
    from safetensors.numpy import save_file
    from transformers import GenerationConfig

    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = hf_config(meta, tied)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    hf_tokenizer(meta).save_pretrained(out_dir)
    tensors = hf_tensors(reader, config.num_hidden_layers, config.num_attention_heads,
                         config.num_key_value_heads)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # readable like the other files
