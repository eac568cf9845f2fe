"""`jaxpaged import` / `gguf_import.import_gguf`: GGUF files of every supported architecture become
HF folders equal to transformers' own GGUF loading of the same file.

The GGUF files are written here with the `gguf` package from tiny random transformers models, the
way llama.cpp's `convert_hf_to_gguf.py` writes them: its metadata keys and tensor names, llama's
q/k row permutation, Gemma's norm weights stored as 1 + w; one file holds Q8_0 and Q4_K tensors.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from jaxpaged.model_loader.gguf_import import SUPPORTED_GGUF_ARCHITECTURES, import_gguf  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def byte_level_vocab():
    """A tiny byte-level BPE vocabulary ("gpt2" in GGUF): 3 control tokens, the 256 byte
    symbols and a few merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ w", "r e", "Ġ s", "l l",
              "e ll", "h ell", "hell o"]
    tokens = specials + list(bytes_to_unicode().values()) + ["".join(m.split()) for m in merges]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))  # CONTROL, NORMAL
    return tokens, types, merges


def sentencepiece_vocab():
    """A tiny sentencepiece vocabulary ("llama" in GGUF) shaped like Gemma's: control tokens,
    byte fallback tokens, scored pieces (one of them real spaces, as Gemma files store them)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["▁", "e", "t", "a", "o", "h", "l", "n", "s", "r", "d", "w", "i", "▁t", "he", "▁the",
              "ll", "▁w", "or", "ld", "▁wor", "▁world", "el", "▁h", "▁he", "▁hel", "▁hell",
              "▁hello", "  "]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(pieces)  # CONTROL, UNKNOWN, BYTE, NORMAL
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def llama_cpp_permute(w, n_head, n_head_kv):
    """`LlamaModel.permute` of llama.cpp's convert_hf_to_gguf.py."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def random_q4_k(rows, cols, seed=0):
    """Valid Q4_K blocks: `gguf` cannot quantize to Q4_K, so random 6-bit scales and 4-bit
    quants under small float16 super-block scales."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-3, size=(n, 2)).astype(np.float16)  # d, dmin
    blocks[:, :4] = d.view(np.uint8).reshape(n, 4)
    return blocks.reshape(rows, cols // 256 * 144)


def add_tokenizer(w, tokenizer, arch):
    """Writes the tiny "gpt2" (byte-level BPE) or sentencepiece ("spm") vocabulary and its
    special tokens as llama.cpp does; returns the tokens."""
    if tokenizer == "gpt2":
        tokens, types, merges = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    else:
        tokens, types, scores = sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
    return tokens


def add_moe_metadata(w, arch, cfg):
    """The expert counts (and the Qwen MoE files' expert FFN sizes) convert_hf_to_gguf.py
    writes for a config with experts."""
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def write_gguf(path, arch, model, *, tokenizer, quant=None, name=None, tensors=None):
    """Writes the transformers `model` as llama.cpp does for `arch`; `quant`: {HF name: type};
    `tensors`: {HF name: f32 array} to write in place of the model's state dict (an MoE's,
    its experts stacked as convert_hf_to_gguf.py stacks them)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    if name:
        w.add_name(name)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"] if "full_attention" in rope
                         else rope["rope_theta"])
    if arch in ("llama", "phi3"):
        w.add_rope_dimension_count(head_dim)
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
    if arch in ("qwen3", "qwen3moe", "gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    add_moe_metadata(w, arch, cfg)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quant else gguf.LlamaFileType.ALL_F32)
    tokens = add_tokenizer(w, tokenizer, arch)
    assert len(tokens) == cfg.vocab_size
    gguf_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(gguf_arch, cfg.num_hidden_layers)
    if tensors is None:
        tensors = {k: t.detach().float().numpy().copy() for k, t in model.state_dict().items()}
    for hf_name, data in tensors.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            kv = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            data = llama_cpp_permute(data, cfg.num_attention_heads, kv)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        qtype = (quant or {}).get(hf_name)
        if qtype is None:
            w.add_tensor(gguf_name, data)
        else:
            raw = random_q4_k(*data.shape) if qtype == Q.Q4_K else gguf.quants.quantize(data, qtype)
            w.add_tensor(gguf_name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


N_BPE, N_SPM = len(byte_level_vocab()[0]), len(sentencepiece_vocab()[0])
SHAPE = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
# GGUF arch -> (HF model_type, config fields, tokenizer kind, quantized tensors)
CASES = {
    "llama": ("llama", dict(vocab_size=N_BPE, tie_word_embeddings=False, rope_theta=100000.0),
              "gpt2", {"model.layers.0.mlp.down_proj.weight": Q.Q4_K,
                       "model.layers.1.self_attn.q_proj.weight": Q.Q8_0,
                       "model.layers.1.self_attn.k_proj.weight": Q.Q8_0}),
    "qwen2": ("qwen2", dict(vocab_size=N_BPE, tie_word_embeddings=True, rope_theta=1e6), "gpt2",
              None),
    "qwen3": ("qwen3", dict(vocab_size=N_BPE, tie_word_embeddings=False, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=128), "gpt2", None),
    "gemma2": ("gemma2", dict(vocab_size=N_SPM, head_dim=16, sliding_window=8), "spm", None),
    "gemma3": ("gemma3_text", dict(vocab_size=N_SPM, head_dim=32, num_key_value_heads=1,
                                   sliding_window=8), "spm",
               {"model.layers.1.mlp.down_proj.weight": Q.Q4_K}),
    "phi3": ("phi3", dict(vocab_size=N_BPE, tie_word_embeddings=False, pad_token_id=0,
                          eos_token_id=2, bos_token_id=0), "gpt2", None),
}


@pytest.fixture(scope="module", params=list(CASES))
def imported(request, tmp_path_factory):
    """(arch, the source transformers model, the GGUF's folder, the imported folder)."""
    return _build(request.param, tmp_path_factory)


def _build(arch, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields, tokenizer, quant = CASES[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **{**SHAPE, **fields}))
    with torch.no_grad():  # make norms and biases random too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    src = tmp_path_factory.mktemp(f"{arch}-gguf")
    write_gguf(src / "model.gguf", arch, model, tokenizer=tokenizer, quant=quant)
    out = tmp_path_factory.mktemp(f"{arch}-hf")
    import_gguf(src / "model.gguf", out, progress=False)
    return arch, model, src, out


def test_tensors_equal_transformers_gguf_loading(imported):
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    arch, source, src, out = imported
    reference = AutoModelForCausalLM.from_pretrained(src, gguf_file="model.gguf",
                                                     dtype=torch.float32).state_dict()
    ours = load_file(out / "model.safetensors")
    tied = source.config.tie_word_embeddings
    assert set(ours) == set(reference) - ({"lm_head.weight"} if tied else set())
    quantized = set(CASES[arch][3] or ())
    for name, tensor in ours.items():
        assert tensor.dtype == np.float32, name
        np.testing.assert_array_equal(tensor, reference[name].numpy(), err_msg=name)
        if name not in quantized:  # and the round trip gives back the source model's weights
            want = source.state_dict()[name].numpy()
            np.testing.assert_allclose(tensor, want, rtol=0, atol=1e-6, err_msg=name)
    for name in quantized:  # dequantized, not zeros or garbage
        assert np.isfinite(ours[name]).all() and np.abs(ours[name]).max() > 0, name


def _close(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        return type(a) is type(b) and _close(dataclasses.astuple(a), dataclasses.astuple(b))
    return a == b


def test_config_matches_transformers_and_the_engine_reads_it(imported):
    from transformers import AutoConfig

    from jaxpaged.models.registry import load_config, model_class

    arch, source, src, out = imported
    ours = json.loads((out / "config.json").read_text())
    reference = AutoConfig.from_pretrained(src, gguf_file="model.gguf").to_dict()
    assert ours["model_type"] == reference["model_type"] == source.config.model_type
    assert ours["architectures"] == [type(source).__name__]
    reference["architectures"] = ours["architectures"]  # transformers' GGUF config has none
    engine = load_config(out)
    want = model_class(ours).config_class.from_hf_dict(reference)
    for field in dataclasses.fields(engine):
        assert _close(getattr(engine, field.name), getattr(want, field.name)), field.name
    # float32 metadata comes back as the decimal the HF config had
    assert ours["rms_norm_eps"] == source.config.rms_norm_eps
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name


TEXTS = ["hello the world", " well  hello\n\nthere", "café 🙂 12345", "<|im_start|>user\nhi<|im_end|>",
         "<start_of_turn>hello<end_of_turn>", "UPPER lower 'quotes'"]


def test_tokenizer_encodes_like_transformers_gguf_conversion(imported):
    from transformers import AutoTokenizer

    _, _, src, out = imported
    reference = AutoTokenizer.from_pretrained(src, gguf_file="model.gguf")
    ours = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids) == reference.decode(ids), text
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    if reference.chat_template:
        chat = [{"role": "user", "content": "hello"}]
        assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def _unsupported_gguf(path):
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    _unsupported_gguf(tmp_path / "falcon.gguf")
    with pytest.raises(ValueError, match="'falcon'") as e:
        import_gguf(tmp_path / "falcon.gguf", tmp_path / "out")
    supported = {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen2moe", "qwen3moe"}
    for arch in supported:
        assert arch in str(e.value)
    assert set(SUPPORTED_GGUF_ARCHITECTURES) == supported
    assert not (tmp_path / "out").exists()


def _cli(*args, home):
    env = dict(os.environ, JAXPAGED_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "jaxpaged.entrypoints.cli", "import", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_import_without_torch(tmp_path_factory, tmp_path):
    """`jaxpaged import FILE [OUT]` writes the same folder, with torch unavailable (one
    architecture: the importer's code is the same for all)."""
    _, _, src, out = _build("gemma3", tmp_path_factory)
    code = ("import sys; sys.modules['torch'] = None\n"
            "from jaxpaged.entrypoints.cli import main\n"
            "sys.exit(main(['import', sys.argv[1], sys.argv[2]]))")
    res = subprocess.run([sys.executable, "-c", code, str(src / "model.gguf"),
                          str(tmp_path / "cli")], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, JAXPAGED_HOME=str(tmp_path)))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith(str(tmp_path / "cli"))
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "cli" / name).read_bytes() == (out / name).read_bytes(), name
    # no OUT: $JAXPAGED_HOME/models/<file name>; an existing folder is not overwritten
    res = _cli(str(src / "model.gguf"), home=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "models" / "model" / "model.safetensors").is_file()
    res = _cli(str(src / "model.gguf"), home=tmp_path)
    assert res.returncode == 2 and "not an empty folder" in res.stderr
    _unsupported_gguf(tmp_path / "falcon.gguf")
    res = _cli(str(tmp_path / "falcon.gguf"), str(tmp_path / "f"), home=tmp_path)
    assert res.returncode == 2 and "'falcon'" in res.stderr and "gemma3" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli", "falcon.gguf", "models"]
