"""Offline throughput, in the manner of vLLM's benchmark_throughput: jaxpaged against its peers.

Every backend replays exactly the same requests (written to a JSONL file first), each generating
its requested number of tokens (EOS ignored). Reports elapsed seconds, requests/s, output tokens/s
and total tokens/s per backend, and the ratio of jaxpaged to each peer, as JSON in bench/results/.

    python bench/throughput.py --num-prompts 32 --input-len 128 --output-len 64

Backends:
  jaxpaged  `LLM.generate` over the whole request set (continuous batching).
  hf        transformers `generate` with static batches of --hf-batch-size (left padding; a batch
            runs until its longest request ends), greedy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def make_requests(args, vocab_size: int) -> list[dict]:
    """Synthetic requests: uniform random prompt ids of --input-len, --output-len each, seed 0."""
    rng = np.random.default_rng(args.seed)
    return [{"prompt_token_ids": rng.integers(100, vocab_size, args.input_len).tolist(),
             "output_len": args.output_len} for _ in range(args.num_prompts)]


def run_jaxpaged(requests, args) -> float:
    from jaxpaged import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=args.max_num_seqs)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True)
              for r in requests]
    if args.warmup:  # compile every bucket the workload touches, untimed
        llm.generate(prompts, params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [r["output_len"] for r in requests]
    return elapsed


def run_hf(requests, args) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpaged.model_store import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model),
                                                 dtype=torch.float32).eval()
    pad = model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id
    start = time.perf_counter()
    for i in range(0, len(requests), args.hf_batch_size):
        batch = requests[i:i + args.hf_batch_size]
        width = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):  # left padding
            n = len(r["prompt_token_ids"])
            ids[row, width - n:] = torch.tensor(r["prompt_token_ids"])
            mask[row, width - n:] = 1
        new = max(r["output_len"] for r in batch)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad)
    return time.perf_counter() - start


BACKENDS = {"jaxpaged": run_jaxpaged, "hf": run_hf}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", nargs="+", default=["jaxpaged", "hf"], choices=list(BACKENDS))
    p.add_argument("--model", default=None, help="local HF folder; default: embedded SmolLM2")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=32, help="jaxpaged sequences per step")
    p.add_argument("--hf-batch-size", type=int, default=32, help="hf static batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--out", type=Path, default=RESULTS / "throughput.json")
    args = p.parse_args(argv)

    from jaxpaged.model_store import resolve_model
    from jaxpaged.models import LlamaConfig

    vocab = LlamaConfig.from_pretrained(resolve_model(args.model)).vocab_size
    requests = make_requests(args, vocab)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".requests.jsonl"), "w") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")

    num_in = sum(len(r["prompt_token_ids"]) for r in requests)
    num_out = sum(r["output_len"] for r in requests)
    results = {}
    for name in args.backend:
        elapsed = BACKENDS[name](requests, args)
        results[name] = {"elapsed_s": elapsed, "requests_per_s": len(requests) / elapsed,
                         "output_tokens_per_s": num_out / elapsed,
                         "total_tokens_per_s": (num_in + num_out) / elapsed}
    ratios = {f"jaxpaged/{peer}": results["jaxpaged"]["output_tokens_per_s"]
              / results[peer]["output_tokens_per_s"]
              for peer in results if peer != "jaxpaged" and "jaxpaged" in results}
    report = {"config": {k: str(v) for k, v in vars(args).items()}, "results": results,
              "ratios_output_tokens_per_s": ratios}
    args.out.write_text(json.dumps(report, indent=2))

    print(f"\n{'backend':<10} {'elapsed s':>10} {'req/s':>8} {'out tok/s':>10} {'tot tok/s':>10}")
    for name, r in results.items():
        print(f"{name:<10} {r['elapsed_s']:>10.2f} {r['requests_per_s']:>8.2f} "
              f"{r['output_tokens_per_s']:>10.1f} {r['total_tokens_per_s']:>10.1f}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x output tokens/s")
    return report


if __name__ == "__main__":
    main()
