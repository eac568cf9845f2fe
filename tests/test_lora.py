"""LoRA adapters against transformers + peft: requests under three adapters and the base model,
mixed in one batch, give peft's greedy ids and log-probabilities (teacher-forced on the
engine's tokens, float32, within 1e-4) for tiny Llama, Qwen2 and Gemma 3 configs, rsLoRA and
adapters on a subset of the projections included; the same on an int8 base and under tensor
parallelism; completion log-probabilities and beam search under an adapter. The adapters'
lifecycle (loading, slots, errors, the server) is tests/test_lora_adapters.py's."""

import json

import numpy as np
import pytest
import torch
import transformers
from lora_utils import (ADAPTERS, GREEDY, PROMPTS, check_against, hf_logprobs, mixed,
                        requests, save_adapter)
from lora_utils import llama_adapters  # noqa: F401 (a fixture)
from peft import PeftModel

from conftest import TINY_CONFIG, copy_tokenizer
from jaxpaged import LoRARequest

COMMON = dict(TINY_CONFIG, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        head_dim=16, sliding_window=16, query_pre_attn_scalar=16, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"])),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, tiny_model_dir):
    """(model dir, {adapter: folder}, HF base model) of a tiny random checkpoint."""
    name = request.param
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    path = tmp_path_factory.mktemp(f"lora-{name}")
    model.save_pretrained(path / "base")
    copy_tokenizer(tiny_model_dir, path / "base")
    folders = {}
    for seed, (adapter, spec) in enumerate(ADAPTERS.items()):
        folders[adapter] = path / adapter
        save_adapter(model, folders[adapter], *spec, seed=seed + 1)
    return path / "base", folders, model_cls.from_pretrained(path / "base").eval()


def test_adapters_mixed_in_one_batch_equal_peft(family, make_llm):
    model_dir, folders, base = family
    llm = make_llm(model_dir, enable_lora=True, max_loras=3, max_lora_rank=16)
    reqs = requests(folders) * 2  # every adapter twice, in one batch
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], GREEDY, use_tqdm=False,
                        lora_request=[lora for _, lora in reqs])
    for (prompt, lora), out in zip(reqs, outs):
        ids = list(out.outputs[0].token_ids)
        got = [next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs]
        want, argmax = hf_logprobs(base, folders, lora and lora.lora_name, prompt, ids)
        assert ids == argmax, (lora, ids, argmax)
        np.testing.assert_allclose(got, want, atol=1e-4)
    # the adapters change the outputs (else this test could not fail)
    first = [list(o.outputs[0].token_ids) for o in outs[:4]]
    alone = llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:4]], GREEDY,
                         use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in alone] != first


def test_adapters_on_an_int8_base_equal_peft_on_its_dequantized_weights(
        tiny_model_dir, llama_adapters, make_llm):
    from jaxpaged.pallas_kernels.quantized_matmul import quantize_int8

    base, folders = llama_adapters
    llm = make_llm(tiny_model_dir, enable_lora=True, max_loras=3, quantization="int8")
    results = mixed(llm, folders)
    dequantized = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():  # the engine quantizes every linear layer and the embedding
        for name, p in dequantized.named_parameters():
            if p.ndim == 2:
                q, scale = (np.asarray(x) for x in quantize_int8(p.numpy()))
                p.copy_(torch.from_numpy(q.astype(np.float32) * scale[:, None]))
    check_against(dequantized, folders, results)


TP_SIZES = (2, 4)  # 4 devices: each KV head on two of them


@pytest.fixture(scope="module")
def tp_results(tiny_model_dir, llama_adapters):
    """`mixed`'s results of an engine under each of `TP_SIZES`, all run in one fresh process of
    4 CPU devices (jax reads the device count once): {tp: results}."""
    import os
    import subprocess
    import sys

    _, folders = llama_adapters
    script = f"""
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count={max(TP_SIZES)}"
from jaxpaged import LLM
import lora_utils
folders = {{k: v for k, v in {({k: str(v) for k, v in folders.items()})!r}.items()}}
for tp in {TP_SIZES!r}:
    llm = LLM({str(tiny_model_dir)!r}, tensor_parallel_size=tp, enable_lora=True, max_loras=3,
              max_model_len=256, num_kv_blocks=64, precompile=False)
    print("RESULT", tp, json.dumps(lora_utils.mixed(llm, folders)), flush=True)
    del llm
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=os.path.dirname(__file__), timeout=600)
    results = {}
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            tp, found = line.removeprefix("RESULT ").split(" ", 1)
            results[int(tp)] = json.loads(found)
    assert sorted(results) == list(TP_SIZES), res.stdout[-2000:] + res.stderr[-4000:]
    return results


@pytest.mark.parametrize("tp", TP_SIZES)
def test_adapters_under_tensor_parallelism_equal_peft(llama_adapters, tp_results, tp):
    base, folders = llama_adapters
    check_against(base, folders, tp_results[tp])


def test_completion_logprobs_and_beam_search_under_an_adapter(tiny_model_dir, llama_adapters,
                                                             make_llm):
    from jaxpaged import BeamSearchParams

    base, folders = llama_adapters
    llm = make_llm(tiny_model_dir, enable_lora=True, max_loras=2, block_size=8,
                   num_kv_blocks=256)
    a1 = LoRARequest("a1", 1, str(folders["a1"]))
    prompt, completion = PROMPTS[2], [100, 200, 300, 400, 500]
    got = llm.completion_logprobs([prompt], [completion], lora_request=a1)[0]
    want, _ = hf_logprobs(base, folders, "a1", prompt, completion)
    np.testing.assert_allclose(got, want, atol=1e-4)
    best = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=4,
                           max_tokens=6), lora_request=a1)[0].sequences[0]
    model = PeftModel.from_pretrained(base, folders["a1"]).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=4, do_sample=False,
                             max_new_tokens=6, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    model.unload()
    assert best.tokens == out.sequences[0].tolist()
    assert abs(best.score - float(out.sequences_scores[0])) < 1e-4
