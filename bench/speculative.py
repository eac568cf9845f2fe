"""Speculative decoding: output tok/s with and without it, acceptance beside each speedup.

    python bench/speculative.py                       # default model, n-gram, k = 11
    python bench/speculative.py --draft-model PATH    # a draft model instead

Workloads (greedy):
  grounded  input-grounded requests whose answers quote their input, through the chat
            template: "repeat this text, fixing its typos" (ShareGPT answers with letters
            swapped), "rename a variable in this Python function" (functions of Python's
            standard library), "summarize, quoting the source"; each ends at EOS or after as
            many tokens as its source has (at most --max-output).
  sharegpt  ShareGPT conversations (bench/sharegpt.py), output lengths as recorded (at most
            --max-output), EOS ignored.
each at batch 1 (requests one after another, `max_num_seqs=1`) and batch 32 (all requests
submitted, `max_num_seqs=32`). Each run comes after an untimed one (at batch 1 the same
requests, at batch 32 four of them), so that compilation stays out of the timing.

Also measured, for the default of `disable_by_batch_size`: the time of a decode step of B
sequences each verifying k proposals (B * (k + 1) tokens) over that of a plain decode step (B
tokens), for B in 1..32: speculation pays while the tokens a verifying step yields (the mean
accepted length) exceed that ratio.

JSON goes to bench/results/speculative.json; a table is printed last.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import portable_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _typos(text: str, rng: random.Random, rate: float = 0.03) -> str:
    """`text` with about `rate` of its words' two middle letters swapped."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 4 and rng.random() < rate * 3:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def _functions(limit: int) -> list[str]:
    """Source of short functions from Python's standard library (textwrap, json, shlex, ...)."""
    import json.encoder
    import shlex
    import string
    import textwrap

    out = []
    for module in (textwrap, json.encoder, shlex, string):
        source = inspect.getsource(module)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                text = ast.get_source_segment(source, node)
                if text and 200 < len(text) < 1200:
                    out.append(text)
    return out[:limit]


def grounded_requests(tokenizer, n: int, max_output: int, seed: int = 0
                      ) -> list[tuple[str, int, bool]]:
    """(chat prompt, output length, ignore_eos) of n input-grounded requests (module doc)."""
    from sharegpt import load_records

    rng = random.Random(seed)
    answers = [c[1]["value"] for r in load_records()
               if len(c := r.get("conversations", [])) >= 2 and 300 < len(c[1]["value"]) < 1200
               and "```" not in c[1]["value"]]
    rng.shuffle(answers)
    functions = _functions(n)
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            source = answers[i]
            ask = f"Repeat the following text exactly, fixing any typos:\n\n{_typos(source, rng)}"
        elif kind == 1:
            source = functions[i % len(functions)]
            ask = ("Rewrite this Python function with the variable `text` renamed to `s`, "
                   "keeping everything else as it is, docstring included:\n\n"
                   f"```python\n{source}\n```")
        else:
            source = answers[i]
            ask = f"Summarize this text, quoting its key sentences word for word:\n\n{source}"
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": ask}],
                                               tokenize=False, add_generation_prompt=True)
        out.append((prompt, min(max_output, len(tokenizer(source).input_ids)), False))
    return out


def sharegpt_requests(tokenizer, n: int, max_output: int) -> list[tuple[str, int, bool]]:
    from sharegpt import sample_requests

    return [(p, min(max_output, o), True) for p, _, o in sample_requests(tokenizer, n)]


def run(llm, requests, batch: int) -> dict:
    """Generates every request (at most `batch` at once); output tok/s and acceptance."""
    from jaxpaged import SamplingParams

    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=ignore)
              for _, o, ignore in requests]
    prompts = [p for p, _, _ in requests]
    start = time.perf_counter()
    if batch == 1:
        outs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = sum(o.metrics.spec_num_drafts for o in outs)
    proposed = sum(o.metrics.spec_num_draft_tokens for o in outs)
    accepted = sum(o.metrics.spec_num_accepted_tokens for o in outs)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def verification_cost(llm, k: int, batches=(1, 2, 4, 8, 16, 32), repeats: int = 5) -> dict:
    """Seconds of a decode-only step of B * (k + 1) tokens over one of B tokens (module doc),
    on the engine's runner with padding-only inputs of those sizes (nothing written)."""
    import jax

    runner = llm.llm_engine.runner
    out = {}
    for B in batches:
        times = []
        for T in (B, B * (k + 1)):
            batch = runner.inputs.padding(runner.step_tokens(T))
            jax.block_until_ready(runner.run_model(batch))  # compiles
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(runner.run_model(batch))
                best = min(best, time.perf_counter() - start)
            times.append(best)
        out[B] = {"plain_s": times[0], "verify_s": times[1], "ratio": times[1] / times[0]}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: embedded SmolLM2-135M-Instruct")
    p.add_argument("--draft-model", default=None, help="a draft model instead of n-grams")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=11,
                   help="11: a verifying step of 12 tokens, a whole step bucket")
    p.add_argument("--prompt-lookup-max", type=int, default=3)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64, help="requests at batch 32")
    p.add_argument("--num-prompts-batch1", type=int, default=6)
    p.add_argument("--max-output", type=int, default=192)
    p.add_argument("--workloads", nargs="+", default=["grounded", "sharegpt"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    args = p.parse_args(argv)

    from jaxpaged import LLM

    k = args.num_speculative_tokens
    spec = ({"model": args.draft_model, "num_speculative_tokens": k} if args.draft_model else
            {"method": "ngram", "num_speculative_tokens": k,
             "prompt_lookup_max": args.prompt_lookup_max,
             "prompt_lookup_min": args.prompt_lookup_min})
    common = dict(model=args.model, max_model_len=2048 + args.max_output)
    results = {"config": portable_config(args), "speculative_config": spec, "runs": {}}
    llms = {}
    for batch in args.batches:
        for mode, extra in (("plain", {}), ("spec", {"speculative_config": spec})):
            llms[batch, mode] = LLM(**common, max_num_seqs=batch, **extra)
    tokenizer = llms[args.batches[0], "plain"].get_tokenizer()
    workloads = {}
    for name in args.workloads:
        n = max(args.num_prompts, args.num_prompts_batch1)
        workloads[name] = (grounded_requests(tokenizer, n, args.max_output) if name == "grounded"
                           else sharegpt_requests(tokenizer, n, args.max_output))
    rows = []
    for name, requests in workloads.items():
        for batch in args.batches:
            reqs = requests[:args.num_prompts_batch1 if batch == 1 else args.num_prompts]
            r = {}
            for mode in ("plain", "spec"):
                # Untimed first: the step and sampler shapes the run meets (and at batch 1 the
                # prompts' prefix cache, as in a second pass of any run), compiled.
                run(llms[batch, mode], reqs if batch == 1 else reqs[:4], batch)
                r[mode] = run(llms[batch, mode], reqs, batch)
            same = r["plain"].pop("token_ids") == r["spec"].pop("token_ids")
            speedup = r["spec"]["output_tok_s"] / r["plain"]["output_tok_s"]
            results["runs"][f"{name}-b{batch}"] = {**r, "speedup": speedup,
                                                   "greedy_ids_equal": same}
            rows.append((name, batch, r["plain"]["output_tok_s"], r["spec"]["output_tok_s"],
                         speedup, r["spec"]["acceptance_rate"],
                         r["spec"]["mean_accepted_length"], same))
    results["verification_cost"] = verification_cost(llms[args.batches[-1], "plain"], k)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'workload':10} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} "
          f"{'accept':>6} {'mean len':>8} {'ids equal':>9}")
    for name, b, a, s, x, rate, length, same in rows:
        print(f"{name:10} {b:5d} {a:11.1f} {s:10.1f} {x:7.2f} "
              f"{(rate or 0):6.2f} {(length or 0):8.2f} {str(same):>9}")
    print("verification step / plain step, by batch:",
          {b: round(v["ratio"], 2) for b, v in results["verification_cost"].items()})
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
