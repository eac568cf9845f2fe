"""The GPU, end to end, in one prepared run: a real model and a 0.5B one in bfloat16 against
transformers on the same GPU, where a step's time goes, and the decode kernel's bandwidth.

    python bench/gpu_e2e.py                # on a GPU machine: bench/results/gpu-e2e.json
    python bench/gpu_e2e.py --smoke        # anywhere (CPU): a tiny random model, small shapes

1. Throughput. For the default model (SmolLM2-135M) and a Qwen2-0.5B-shaped model with random
   weights (`synthetic_models.py qwen2-0.5b`, written from its config on the machine), in
   `--dtype`: the `--num-prompts` ShareGPT set, greedy, EOS ignored, through `LLM` (its
   default, 8 decode steps a call; and one step a call with `async_scheduling`) and through
   transformers' continuous batching on the same folder and device (`throughput.py`'s
   `run_jaxpaged`, `run_hf_cb`): output tokens/s of each and the ratios. The pool is sized
   by `gpu_memory_utilization` (its default on a GPU).
2. A decode step at `--batch` sequences, one step a call: synchronous (`roofline.Timers`: each
   model step and sampler call waited for and timed), the device step, the sampler, and the
   rest of the engine step on the host (preparing the batch, book-keeping), during which the
   device idles; its share of the step is the idle time. Then with `async_scheduling`, where
   the host works while the device runs: its step beyond the synchronous device step and
   sampler is its idle time.
3. The Pallas decode kernel over a pool of 64 sequences x 2048 tokens x 8 KV heads of 128 in
   `--dtype`, int8 and fp8, against a device-to-device copy of as many bytes in the same run
   (its bandwidth: bytes read and written over the copy's time): each of `LAUNCHES` (KV
   splits, keys per iteration, warps) timed, today's default first; the best per pool, its
   share of the copy's bandwidth and its tokens/s (8-bit pools against the float one).
4. Compilation: the default model's engine built on an empty compilation cache folder (cold),
   then again on the same folder (warm), seconds each.

`--smoke` shrinks everything (a random 2-layer Llama, 4 random 32-token prompts of 8 output
tokens, engines limited to 128 tokens, a 4 x 64-token pool with the kernel interpreted on CPU
and each launch timed twice) so that CI runs the script end
to end (tests/test_gpu_e2e.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import portable_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SMOKE_CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def tiny_model(folder: Path) -> Path:
    """A random 2-layer Llama (`SMOKE_CONFIG`) with the default model's tokenizer."""
    import torch
    import transformers

    from jaxpaged.model_loader.model_store import ensure_default_model

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOKE_CONFIG)).save_pretrained(folder)
    tokenizer = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).exists():
            (folder / name).write_bytes((tokenizer / name).read_bytes())
    return folder


def throughput(model: str, args) -> dict:
    """jaxpaged and transformers' continuous batching on `model`'s folder: output tok/s."""
    import throughput as tp
    import throughput_backends as backends
    from transformers import AutoTokenizer

    from jaxpaged.model_loader.model_store import resolve_model

    folder = resolve_model(model)
    base = dict(
        model=str(folder), dataset="random" if args.smoke else "sharegpt",
        num_prompts=args.num_prompts, seed=0, max_output=args.max_output, input_len=32,
        output_len=args.max_output, max_model_len=args.max_model_len or 2048,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.batch,
        warmup="precompile", batch_invariant=False, attention_backend="auto",
        quantization="none", kv_cache_dtype="auto", temperature=0.0, top_p=1.0, top_k=0,
        dtype=args.dtype, device=args.torch_device)
    ns = argparse.Namespace(**base)
    requests = tp.make_requests(ns, AutoTokenizer.from_pretrained(folder), 1000)
    out = {"num_prompts": len(requests),
           "num_output_tokens": sum(r["output_len"] for r in requests)}
    runs = {"jaxpaged": backends.run_jaxpaged(requests, ns)[""],  # 8 decode steps a call
            "jaxpaged-async": backends.run_jaxpaged(requests, argparse.Namespace(
                **base, num_scheduler_steps=1, async_scheduling=True))[""],
            "hf-cb": backends.run_hf_cb(requests, ns)}
    for name, r in runs.items():
        out[name] = {"elapsed_s": r["elapsed_s"],
                     "output_tokens_per_s": out["num_output_tokens"] / r["elapsed_s"],
                     **({"startup_s": r["startup_s"]} if "startup_s" in r else {})}
    hf = out["hf-cb"]["output_tokens_per_s"]
    out["ratio"] = out["jaxpaged"]["output_tokens_per_s"] / hf
    out["ratio_async"] = out["jaxpaged-async"]["output_tokens_per_s"] / hf
    return out


def _decode_steps(engine, batch: int, steps: int, on_ready=None) -> list[float]:
    """Seconds of each of `steps` engine steps once `batch` sequences decode together (64
    random prompt tokens each, greedy); `on_ready()` is called just before them."""
    from jaxpaged import SamplingParams

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        engine.add_request({"prompt_token_ids": rng.integers(10, 1000, 64).tolist()}, params)
    while (engine.scheduler.waiting or any(s.num_output_tokens < 2
                                            for s in engine.scheduler.running)):
        engine.step()
    engine.step()  # the first steps of this shape (compiled or loaded)
    engine.step()
    if on_ready is not None:
        on_ready()
    totals = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return totals


def step_split(model: str, args, steps: int = 8) -> dict:
    """Median decode step at `args.batch` sequences, synchronous (one step a call): the device
    step and the sampler (each waited for, `roofline.Timers`) and the host (the rest, when the
    device idles); then with async scheduling, untimed inside: its idle share is what its step
    takes beyond the synchronous device step and sampler."""
    from roofline import Timers

    from jaxpaged import LLM

    out = {"batch": args.batch}
    for mode in ("sync", "async"):
        llm = LLM(model, dtype=args.dtype, max_model_len=getattr(args, "max_model_len", None)
                  or 1024, max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
                  max_num_seqs=args.batch,
                  num_scheduler_steps=1, enable_prefix_caching=False,
                  async_scheduling=mode == "async")
        engine = llm.llm_engine
        out.setdefault("kv_pool_blocks", engine.block_manager.num_blocks)
        timers = Timers(engine.runner) if mode == "sync" else None
        totals = _decode_steps(engine, args.batch, steps, timers and timers.reset)
        total = float(np.median(totals))
        if mode == "sync":
            step = float(np.median(timers.step_s))
            sampler = float(np.median(timers.sampler_s)) if timers.sampler_s else 0.0
            host = total - step - sampler
            out.update(engine_step_ms=1e3 * total, device_step_ms=1e3 * step,
                       sampler_ms=1e3 * sampler, host_ms=1e3 * host, idle_share=host / total)
        else:
            busy = (out["device_step_ms"] + out["sampler_ms"]) / 1e3
            out.update(async_engine_step_ms=1e3 * total,
                       async_idle_share=max(0.0, total - busy) / total)
        del llm, engine
    return out


def kernel_bandwidth(args) -> dict:
    """The Pallas decode kernel's GB/s over each pool kind against a device copy's."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxpaged.pallas_kernels.paged_attention import paged_attention
    from jaxpaged.pallas_kernels.reference import KV_CODE_DTYPES, quantize_kv

    B, ctx, K, N, H, S = (4, 64, 2, 4, 64, 16) if args.smoke else (64, 2048, 8, 32, 128, 16)
    dtype = jnp.float32 if args.dtype == "auto" else jnp.dtype(args.dtype)
    P = B * ctx // S
    k = jax.random.normal(jax.random.key(0), (K, P, S, H), dtype)
    v = jax.random.normal(jax.random.key(1), (K, P, S, H), dtype)
    q = jax.random.normal(jax.random.key(2), (B, N, H), dtype)
    tables = jnp.arange(P, dtype=jnp.int32).reshape(B, ctx // S)
    lens = jnp.full((B,), ctx, jnp.int32)
    pools = {jnp.dtype(dtype).name: (k, v, None, None)}
    for kind in ("int8", "fp8"):
        (kc, ks), (vc, vs) = (quantize_kv(x, KV_CODE_DTYPES[kind][0]) for x in (k, v))
        pools[kind] = (kc, vc, ks, vs)
    copy = jax.jit(lambda x: x * 2)  # reads and writes every byte once
    out = {"shape": {"seqs": B, "context": ctx, "kv_heads": K, "head_dim": H}}
    flat = jnp.concatenate([k.reshape(-1), v.reshape(-1)])
    repeats = 2 if args.smoke else 10
    seconds = _best(lambda: copy(flat).block_until_ready(), repeats)
    out["copy"] = {"seconds": seconds, "GB_per_s": 2 * flat.nbytes / seconds / 1e9}
    for kind, (kp, vp, ks, vs) in pools.items():
        read = sum(x.nbytes for x in (kp, vp, ks, vs) if x is not None)
        sweep = []
        for launch in LAUNCHES[:2] if args.smoke else LAUNCHES:
            fn = jax.jit(functools.partial(
                paged_attention, block_tables=tables, context_lens=lens, scale=H ** -0.5,
                interpret=jax.default_backend() == "cpu", **launch))
            try:
                seconds = _best(lambda: fn(q, kp, vp, k_scales=ks, v_scales=vs)
                                .block_until_ready(), repeats)
            except Exception as e:  # a launch the compiler refuses for this shape
                sweep.append({**launch, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            sweep.append({**launch, "seconds": seconds, "GB_per_s": read / seconds / 1e9,
                          "tokens_per_s": B * ctx / seconds})
        timed = [r for r in sweep if "seconds" in r]
        best = min(timed, key=lambda r: r["seconds"])
        out[kind] = {"pool_bytes": read, "default": timed[0] if sweep[0] is timed[0] else None,
                     "best": best, "of_copy": best["GB_per_s"] / out["copy"]["GB_per_s"],
                     "sweep": sweep}
    return out


# The decode kernel's launches timed: today's default first (k_splits 1, 16 keys an iteration,
# 4 warps, 2 stages), then splits, larger key tiles and more warps.
LAUNCHES = [dict(k_splits=1, tokens_per_iter=None, num_warps=4, num_stages=2)] + [
    dict(k_splits=splits, tokens_per_iter=tokens, num_warps=warps, num_stages=2)
    for splits in (1, 4) for tokens in (32, 64, 128) for warps in (4, 8)]


def _best(run, repeats: int = 10) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def compilation(model: str, args) -> dict:
    """Seconds to build the engine (every step shape compiled) in a fresh process on an empty
    compilation cache folder, then in another on the same folder; the engine build alone,
    timed inside each process."""
    import subprocess

    code = ("import sys, time; from jaxpaged import LLM; start = time.perf_counter(); "
            "LLM(sys.argv[1] if sys.argv[1] != 'None' else None, dtype=sys.argv[2], "
            "max_model_len=int(sys.argv[5]), max_num_batched_tokens=int(sys.argv[6]) or None, "
            "max_num_seqs=int(sys.argv[3]), compilation_cache_dir=sys.argv[4]);"
            " print('BUILD_S', time.perf_counter() - start)")
    times = []
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(2):
            proc = subprocess.run([sys.executable, "-c", code, str(model), args.dtype,
                                   str(args.batch), cache, str(args.max_model_len or 1024),
                                   str(args.max_num_batched_tokens or 0)],
                                  capture_output=True, text=True, check=True)
            times.append(float(proc.stdout.split("BUILD_S")[-1]))
    return {"cold_s": times[0], "warm_s": times[1]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, on any machine")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, else auto")
    p.add_argument("--num-prompts", type=int, default=None, help="default 64 (smoke: 4)")
    p.add_argument("--max-output", type=int, default=None, help="default 256 (smoke: 8)")
    p.add_argument("--batch", type=int, default=None, help="default 64 (smoke: 4)")
    p.add_argument("--out", type=Path, default=None,
                   help="default bench/results/gpu-e2e.json (smoke: gpu-e2e-smoke.json)")
    args = p.parse_args(argv)
    start = time.perf_counter()

    import jax
    import torch

    gpu = jax.default_backend() == "gpu"
    args.dtype = args.dtype or ("bfloat16" if gpu else "auto")
    args.num_prompts = args.num_prompts or (4 if args.smoke else 64)
    args.max_output = args.max_output or (8 if args.smoke else 256)
    args.batch = args.batch or (4 if args.smoke else 64)
    # --smoke's workloads fit in 128 tokens: its engines take that as max_model_len and as the
    # step's token budget, so that far fewer token buckets compile (None: the GPU run's limits).
    args.max_model_len = args.max_num_batched_tokens = 128 if args.smoke else None
    args.out = args.out or RESULTS / ("gpu-e2e-smoke.json" if args.smoke else "gpu-e2e.json")
    args.torch_device = "cuda" if gpu and torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            models = {"tiny-llama": str(tiny_model(Path(tmp)))}
        else:
            from synthetic_models import ensure
            models = {"default": None, "qwen2-0.5b": str(ensure("qwen2-0.5b"))}
        report = {"config": {**portable_config(args), "device": str(jax.devices()[0]),
                             "host": platform.processor() or platform.machine()},
                  "throughput": {}}
        for name, model in models.items():
            print(f"[throughput] {name}", flush=True)
            report["throughput"][name] = throughput(model, args)
        first = next(iter(models.values()))
        print("[step split]", flush=True)
        report["step_split"] = step_split(first, args)
        print("[decode kernel]", flush=True)
        report["decode_kernel"] = kernel_bandwidth(args)
        print("[compilation]", flush=True)
        report["compilation"] = compilation(first, args)
    report["run_wall_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for name, r in report["throughput"].items():
        print(f"{name}: jaxpaged {r['jaxpaged']['output_tokens_per_s']:.1f} tok/s "
              f"({r['ratio']:.2f}x), async {r['jaxpaged-async']['output_tokens_per_s']:.1f} "
              f"({r['ratio_async']:.2f}x), hf-cb {r['hf-cb']['output_tokens_per_s']:.1f} tok/s")
    s = report["step_split"]
    print(f"decode step at batch {s['batch']}: {s['engine_step_ms']:.2f} ms, device "
          f"{s['device_step_ms']:.2f}, sampler {s['sampler_ms']:.2f}, host {s['host_ms']:.2f} "
          f"(idle {100 * s['idle_share']:.0f}%); async {s['async_engine_step_ms']:.2f} ms "
          f"(idle {100 * s['async_idle_share']:.0f}%); KV pool {s['kv_pool_blocks']} blocks")
    k = report["decode_kernel"]
    print(f"device copy {k['copy']['GB_per_s']:.1f} GB/s; decode kernel, best launch: " + ", ".join(
        f"{kind} {v['best']['GB_per_s']:.1f} GB/s ({100 * v['of_copy']:.0f}% of the copy, "
        f"{v['best']['tokens_per_s'] / 1e6:.1f} M tokens/s)"
        for kind, v in k.items() if kind not in ("shape", "copy")))
    print(f"compilation: cold {report['compilation']['cold_s']:.1f} s, warm "
          f"{report['compilation']['warm_s']:.1f} s; whole run {report['run_wall_s']:.0f} s")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
