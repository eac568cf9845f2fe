"""Where a model's step time goes: each step-shape bucket's measured time beside its rooflines.

    python bench/roofline.py                                   # SmolLM2, Gemma 3 270M, Qwen2 0.5B
    python bench/roofline.py --models default --batches 1 8 --prefill 128
    python bench/roofline.py --models default --dtype bfloat16 --out bench/results/roofline-bf16.json

For each model, decode steps of B running sequences (B in --batches, each with --context tokens
cached) and prefill steps of one prompt of T tokens (T in --prefill) run through the engine as
serving runs them. Each engine step is split into:
  step     the jitted model step (`StepPrograms.run_step`, waited for),
  sampler  the jitted sampler, its inputs and the copy of its result to the host
           (`StepSampler.draw_on_device`; none for plain greedy decoding, whose draws the step
           makes),
  host     the rest of `LLMEngine.step`: scheduling, building the step's arrays, detokenizing.
Beside the step time stand its lower bounds on this machine:
  weight-read  bytes the step must read (every weight once, the LM head's included, and the
               sequences' cached K/V) / the measured memory bandwidth (a jitted sum of 1 GiB);
  FLOP         the step's matmul FLOPs as compiled (its padded token bucket T, its S logits rows:
               2 x weights x T, 2 x D x V x S for the LM head, attention over the context) / the
               measured float32 matmul peak (a jitted 2048^3 matmul).
`step / bound` says how far the step is from the larger bound. JSON goes to
bench/results/roofline.json; a table is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import best_time, portable_config  # noqa: E402

MODELS = {"default": None, "gemma3-270m": "google/gemma-3-270m", "qwen2-0.5b": "synthetic"}


def machine_peaks(repeats: int = 10) -> dict:
    """Memory read bandwidth (bytes/s, a jitted sum over 1 GiB of float32) and float32 matmul
    peak (FLOP/s, a jitted 2048^3 matmul), best of `repeats`."""
    import jax
    import jax.numpy as jnp

    big = jnp.ones((1 << 28,), jnp.float32)
    total = jax.jit(jnp.sum)
    bandwidth = big.nbytes / best_time(lambda: total(big).block_until_ready(), repeats)
    del big
    n = 2048
    x = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    matmul = jax.jit(jnp.matmul)
    peak = 2 * n**3 / best_time(lambda: matmul(x, x).block_until_ready(), repeats)
    return {"bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": peak}


class Timers:
    """Wraps a runner's model step and sampler so that each call is waited for and timed."""

    def __init__(self, runner):
        import jax

        self.step_s, self.sampler_s = [], []
        self.last_T = 0  # padded tokens of the last step
        programs, draws = runner.programs, runner.sampler
        run_step, sample = programs.run_step, draws.draw_on_device

        def timed_step(leaves, batch, *args, **kwargs):
            self.last_T = len(batch.input_ids)
            start = time.perf_counter()
            out = jax.block_until_ready(run_step(leaves, batch, *args, **kwargs))
            self.step_s.append(time.perf_counter() - start)
            return out

        def timed_sample(*args, **kwargs):
            start = time.perf_counter()
            out = jax.device_get(sample(*args, **kwargs))
            self.sampler_s.append(time.perf_counter() - start)
            return out

        programs.run_step = timed_step
        draws.draw_on_device = timed_sample

    def reset(self):
        self.step_s.clear()
        self.sampler_s.clear()


def step_cost(config, params_bytes: int, embed_bytes: int, tied: bool, T: int, S: int,
              contexts: list[int], dtype_bytes: int) -> tuple[float, float]:
    """(bytes read, matmul FLOPs) of a step of T padded tokens and S logits rows whose
    sequences hold `contexts` tokens each after the step."""
    D, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    per_layer = D * (2 * q_dim + 2 * kv_dim) + 3 * D * config.intermediate_size
    weight_bytes = params_bytes if tied else params_bytes - embed_bytes  # lookups read T rows
    kv_bytes = sum(contexts) * 2 * L * kv_dim * dtype_bytes
    new_tokens = max(1, T // max(1, len(contexts)))
    attention = 4 * L * q_dim * sum(c * min(new_tokens, c) for c in contexts)
    flops = 2 * L * per_layer * T + 2 * D * V * S + attention
    return weight_bytes + kv_bytes, flops


def profile_model(name: str, args, peaks: dict) -> list[dict]:
    import jax

    from jaxpaged import LLM, SamplingParams
    try:
        from jaxpaged.worker.buckets import bucket
    except ImportError:  # a tree from before the subsystem folders (bench/against_commit.py)
        from jaxpaged.buckets import bucket

    model = MODELS[name]
    if model == "synthetic":
        from synthetic_models import ensure
        model = str(ensure(name))
    llm = LLM(model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=max(args.batches), precompile=False, enable_prefix_caching=False,
              attention_backend=args.attention_backend, quantization=args.quantization)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    config = runner.config
    leaves = jax.tree.leaves(runner.params)
    params_bytes = sum(x.nbytes for x in leaves)
    embed_params = runner.params["embed_tokens"]
    embed = (embed_params["embedding"] if "embedding" in embed_params
             else embed_params["weight"])[...]  # QuantizedEmbed: int8 rows
    tied = config.tie_word_embeddings
    timers = Timers(runner)
    rng = np.random.default_rng(0)
    rows = []

    def measure(kind: str, prompts: list[list[int]], warm_steps: int, steps: int) -> None:
        for _ in range(2):  # the first round compiles the shapes, the second is timed
            ids = [engine.add_request({"prompt_token_ids": p}, SamplingParams(
                temperature=0, max_tokens=args.max_model_len - len(p), ignore_eos=True))
                for p in prompts]
            for _ in range(warm_steps):
                engine.step()
            if kind == "decode":  # until every prompt is in (chunked prefill takes steps)
                for _ in range(1000):
                    if timers.last_T == bucket(len(prompts)):
                        break
                    engine.step()
                else:
                    raise RuntimeError(f"{len(prompts)} sequences never decoded together")
            timers.reset()
            totals, hosts = [], []
            for _ in range(steps):
                done_steps, done_samples = len(timers.step_s), len(timers.sampler_s)
                start = time.perf_counter()
                engine.step()
                totals.append(time.perf_counter() - start)
                # this engine step's own host time: its total less its model and sampler calls
                hosts.append(totals[-1] - sum(timers.step_s[done_steps:])
                             - sum(timers.sampler_s[done_samples:]))
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
        B = len(prompts)
        tokens = B if kind == "decode" else len(prompts[0])
        T = bucket(tokens)
        S = runner.limits.num_seqs_bucket(T)
        contexts = ([len(p) + warm_steps + 1 for p in prompts] if kind == "decode"
                    else [len(prompts[0])])
        nbytes, flops = step_cost(config, params_bytes, embed.nbytes, tied, T, S, contexts,
                                  jax.numpy.dtype(args.dtype).itemsize)  # the KV pool's
        step = float(np.median(timers.step_s))
        # No sampler call at all where every draw was a plain greedy one, made by the step.
        sampler = float(np.median(timers.sampler_s)) if timers.sampler_s else 0.0
        total, host = float(np.median(totals)), float(np.median(hosts))
        bw_s = nbytes / peaks["bandwidth_bytes_per_s"]
        flop_s = flops / peaks["matmul_flops_per_s"]
        rows.append(dict(model=name, dtype=args.dtype, quantization=args.quantization,
                         kind=kind, batch=B, tokens=tokens, T=T, logits_rows=S,
                         step_ms=1e3 * step, sampler_ms=1e3 * sampler,
                         host_ms=1e3 * host, engine_step_ms=1e3 * total,
                         weight_read_bound_ms=1e3 * bw_s, flop_bound_ms=1e3 * flop_s,
                         step_over_bound=step / max(bw_s, flop_s),
                         bytes_read=nbytes, flops=flops))
        print(rows[-1], flush=True)

    for B in args.batches:
        prompts = [rng.integers(10, 1000, args.context).tolist() for _ in range(B)]
        measure("decode", prompts, warm_steps=2, steps=args.steps)
    for T in args.prefill:
        measure("prefill", [rng.integers(10, 1000, T).tolist()], warm_steps=0, steps=1)
    return rows


def print_table(rows: list[dict]) -> None:
    head = ("model", "dtype", "kind", "B", "T", "S", "step ms", "w-read ms", "FLOP ms", "step/bound",
            "sampler ms", "host ms")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(str(x) for x in (
            r["model"], r["dtype"], r["kind"], r["batch"], r["T"], r["logits_rows"],
            f"{r['step_ms']:.1f}", f"{r['weight_read_bound_ms']:.1f}",
            f"{r['flop_bound_ms']:.1f}", f"{r['step_over_bound']:.2f}",
            f"{r['sampler_ms']:.1f}", f"{r['host_ms']:.1f}")))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--prefill", nargs="*", type=int, default=[128, 512])
    p.add_argument("--context", type=int, default=256, help="decode: tokens cached per sequence")
    p.add_argument("--steps", type=int, default=6, help="decode steps timed per batch size")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="float32", help="the engine's dtype (float32, bfloat16)")
    p.add_argument("--quantization", default=None, help="LLM(quantization=...): int8, w8a8, q8_0")
    p.add_argument("--attention-backend", default="auto", help="LLM(attention_backend=...)")
    p.add_argument("--out", type=Path, default=Path("bench/results/roofline.json"))
    args = p.parse_args(argv)
    peaks = machine_peaks()
    print(peaks, flush=True)
    rows = [r for name in args.models for r in profile_model(name, args, peaks)]
    report = {"config": portable_config(args), "machine": peaks, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print_table(rows)
    return report


if __name__ == "__main__":
    main()
