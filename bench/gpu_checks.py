"""GPU checks of the 8-bit KV pool and speculative decoding, on a real GPU (one prepared run).

    python bench/gpu_checks.py --out bench/results/gpu-checks.json

1. The Pallas kernels (decode and ragged, compiled for the GPU, not interpreted) over int8 and
   fp8 pools against the jnp reference over the decoded pool, and against float32 K/V within
   the quantization error (as tests/test_quantization.py does in interpret mode on CPU).
2. The Pallas decode kernel's time over a float32 pool and over the 8-bit pools at a
   bandwidth-bound size (64 sequences x 2048 cached tokens, 8 KV heads of 128).
3. A tiny random Llama on the engine with the Pallas backend: greedy ids with an int8 and an
   fp8 KV pool and with int8 weights against float32 (first tokens), and n-gram speculative
   decoding's greedy ids against decoding without it (all tokens), KV blocks all free after.

Writes JSON and prints a table last. Needs a GPU (jax's default backend "gpu").
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path



def kernels(results: dict) -> None:
    import jax
    import jax.numpy as jnp

    from jaxpaged.pallas_kernels.paged_attention import paged_attention, paged_attention_reference
    from jaxpaged.pallas_kernels.ragged_paged_attention import (
        ragged_paged_attention, ragged_paged_attention_reference)
    from jaxpaged.pallas_kernels.reference import KV_CODE_DTYPES, dequantize_kv, quantize_kv

    K, P, S, H, N = 2, 12, 16, 64, 4
    kk, kv = jax.random.split(jax.random.key(1))
    k_pages, v_pages = jax.random.normal(kk, (K, P, S, H)), jax.random.normal(kv, (K, P, S, H))
    tables = jnp.array([[3, 7, 1, 0], [5, 2, 9, 11]], jnp.int32)
    lens = jnp.array([45, 60], jnp.int32)
    scale = H ** -0.5
    for kind in ("int8", "fp8"):
        kc, ks = quantize_kv(k_pages, KV_CODE_DTYPES[kind][0])
        vc, vs = quantize_kv(v_pages, KV_CODE_DTYPES[kind][0])
        kd, vd = dequantize_kv(kc, ks), dequantize_kv(vc, vs)
        with jax.default_matmul_precision("highest"):
            q = jax.random.normal(jax.random.key(2), (2, N, H))
            got = paged_attention(q, kc, vc, block_tables=tables, context_lens=lens,
                                  scale=scale, k_scales=ks, v_scales=vs)
            ref = paged_attention_reference(q, kd, vd, tables, lens, scale=scale)
            exact = paged_attention_reference(q, k_pages, v_pages, tables, lens, scale=scale)
            qr = jax.random.normal(jax.random.key(3), (5, N, H))
            cu = jnp.array([0, 3, 4], jnp.int32)
            got_r = ragged_paged_attention(qr, kc, vc, tables, lens, cu, 2, scale=scale,
                                           k_scales=ks, v_scales=vs)[:4]
            ref_r = ragged_paged_attention_reference(qr, kd, vd, tables, lens, cu, 2,
                                                     scale=scale)[:4]
            exact_r = ragged_paged_attention_reference(qr, k_pages, v_pages, tables, lens, cu,
                                                       2, scale=scale)[:4]
        for name, g, r, e in (("decode", got, ref, exact), ("ragged", got_r, ref_r, exact_r)):
            results[f"kernel-{name}-{kind}"] = {
                "max_abs_err_vs_decoded_reference": float(jnp.max(jnp.abs(g - r))),
                "rel_err_vs_float": float(jnp.max(jnp.abs(g - e)) / jnp.max(jnp.abs(e)))}


def kernel_timing(results: dict) -> None:
    import jax
    import jax.numpy as jnp

    from jaxpaged.pallas_kernels.paged_attention import paged_attention
    from jaxpaged.pallas_kernels.reference import KV_CODE_DTYPES, quantize_kv

    B, ctx, K, N, H, S = 64, 2048, 8, 32, 128, 16
    per_seq = ctx // S
    P = B * per_seq
    k = jax.random.normal(jax.random.key(0), (K, P, S, H), jnp.float32)
    v = jax.random.normal(jax.random.key(1), (K, P, S, H), jnp.float32)
    tables = jnp.arange(P, dtype=jnp.int32).reshape(B, per_seq)
    lens = jnp.full((B,), ctx, jnp.int32)
    q = jax.random.normal(jax.random.key(2), (B, N, H), jnp.float32)
    pools = {"float32": (k, v, None, None)}
    for kind in ("int8", "fp8"):
        kc, ks = quantize_kv(k, KV_CODE_DTYPES[kind][0])
        vc, vs = quantize_kv(v, KV_CODE_DTYPES[kind][0])
        pools[kind] = (kc, vc, ks, vs)
    for kind, (kp, vp, ks, vs) in pools.items():
        fn = jax.jit(functools.partial(paged_attention, block_tables=tables, context_lens=lens,
                                       scale=H ** -0.5))
        run = lambda: fn(q, kp, vp, k_scales=ks, v_scales=vs).block_until_ready()  # noqa: E731
        run()
        best = min(_timed(run) for _ in range(20))
        pool_bytes = sum(x.size * x.dtype.itemsize for x in (kp, vp, ks, vs) if x is not None)
        results[f"decode-kernel-time-{kind}"] = {"seconds": best, "pool_bytes": pool_bytes,
                                                 "GB_per_s": pool_bytes / best / 1e9}


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def engine(results: dict, tokenizer_dir: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from jaxpaged import LLM, SamplingParams

    path = Path(tempfile.mkdtemp()) / "tiny-vocab64"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    ).save_pretrained(path)
    # any tokenizer decodes ids < 64; the engine needs one in the folder
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    prompts = [{"prompt_token_ids": ids} for ids in (
        [5, 6, 7, 8, 9, 10, 5, 6, 7, 8], [10, 20, 30, 10, 20, 30, 10], list(range(3, 43)),
        [42] * 9)]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    common = dict(max_model_len=256, num_kv_blocks=256, attention_backend="pallas",
                  precompile=False)

    def ids(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    ref_llm = LLM(path, **common)
    ref = ids(ref_llm)
    # The float engine's top-2 margin at each token: a quantized engine may differ where the
    # margin is small (a random tiny model has many such tokens).
    scored = ref_llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0,
                                                      ignore_eos=True, logprobs=2),
                              use_tqdm=False)
    margins = [[sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
                for step in o.outputs[0].logprobs] for o in scored]
    margins = [[a - b for a, b in row] for row in margins]
    for name, kw in (("kv-int8", dict(kv_cache_dtype="int8")),
                     ("kv-fp8", dict(kv_cache_dtype="fp8")),
                     ("w-int8", dict(quantization="int8"))):
        got = ids(LLM(path, **common, **kw))
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                 for x, y in zip(ref, got)]
        results[f"engine-{name}"] = {
            "tokens_equal_before_first_difference": first,
            "float_margin_at_first_difference": [
                None if i == len(m) else round(m[i], 4) for i, m in zip(first, margins)]}
    llm = LLM(path, **common, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1})
    got = ids(llm)
    stats = llm.stats()
    results["engine-ngram-speculation"] = {
        "greedy_ids_equal": got == ref, "num_spec_draft_tokens": stats["num_spec_draft_tokens"],
        "num_spec_accepted_tokens": stats["num_spec_accepted_tokens"],
        "all_blocks_free": stats["num_free_blocks"] == stats["num_total_blocks"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu-checks.json"))
    p.add_argument("--tokenizer", required=True, help="a folder with tokenizer files")
    args = p.parse_args(argv)
    import jax

    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    for step in (kernels, kernel_timing, functools.partial(engine, tokenizer_dir=args.tokenizer)):
        try:
            step(results)
        except Exception as e:  # report and go on: one failed check must not hide the others
            name = getattr(step, "__name__", None) or step.func.__name__
            results[f"{name}-error"] = repr(e)[:2000]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for key, value in results.items():
        print(f"{key:40} {value}")
    return results


if __name__ == "__main__":
    main()
