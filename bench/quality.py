"""What quantization costs and saves on one model: quality against float32, bytes, speed at
batch 1, and resident memory when serving a GGUF file directly.

    python bench/quality.py                     # the default model, every mode
    python bench/quality.py --modes int8 kv-int8

Modes: "float32" (the reference), "int8" (weight-only int8, `LLM(quantization="int8")`),
"w8a8" (int8 activations too, `LLM(quantization="w8a8")`), "q8_0" (GGUF Q8_0 blocks,
`LLM(quantization="q8_0")`), "kv-int8" and "kv-fp8"
(`kv_cache_dtype`), and "gguf" (the model's GGUF file served directly, with the default
quantization for GGUF files) when the model is an embedded one.

Quality, each mode against float32 on the same tokens:
- KL divergence per token, teacher forced: 64 ShareGPT conversations (prompt then the
  recorded answer, at most `--max-len` tokens) through the paged engine with
  `prompt_logprobs=20`, each in one step; with an 8-bit pool every key is attended to as the
  pool holds it, the step's own included (`backends.CpuBackend`). KL(p_float || q) is summed over float32's 20 most likely tokens, each
  token's q read from the mode's top 20 (the mode's 20th log-probability where the token is
  not among them): a truncation of the full sum; `top20_mass` is the probability it covers.
- perplexity of the same teacher-forced tokens;
- greedy agreement on the golden prompts (the parity test's): the fraction of the float32 engine's first 32
  greedy tokens each mode reproduces before its first difference.
Bytes: `llm.stats()`'s `weight_bytes` and `kv_cache_bytes_per_token`. Speed: TPOT at batch 1
(one 128-token greedy completion after the first token, median of 3). Memory: each mode's
engine built in a fresh process, its resident set (VmRSS) after a generate.

Writes bench/results/quality.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharegpt import load_records  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# The parity test's prompts (tests/test_parity.py), whose float32 greedy ids equal transformers'.
GOLDEN_PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about paged attention and the memory it saves:",
    "Yapay zeka gelecekte yazılım geliştiricilerin yerini alabilir mi?",
    "List three prime numbers greater than one hundred and explain how you checked each of them.",
    "In 1969, the first humans walked on the Moon. Describe the mission in detail, including the "
    "crew, the spacecraft, the landing site and what they brought back to Earth for study.",
]

MODES = {"float32": {}, "int8": dict(quantization="int8"), "w8a8": dict(quantization="w8a8"),
         "q8_0": dict(quantization="q8_0"), "kv-int8": dict(kv_cache_dtype="int8"), "kv-fp8": dict(kv_cache_dtype="fp8"),
         "gguf": {}}


def engine_options(mode: str, model, args) -> dict:
    from jaxpaged.model_loader.model_store import EMBEDDED_MODELS, DEFAULT_MODEL

    options = dict(MODES[mode], max_model_len=args.max_len + 160, max_num_seqs=16,
                   precompile=False)
    if mode == "gguf":
        options["model"] = str(EMBEDDED_MODELS[model or DEFAULT_MODEL].find_gguf())
    else:
        options["model"] = model
    return options


def teacher_forced(tokenizer, n: int, max_len: int) -> list[list[int]]:
    """Token ids of n ShareGPT conversations, prompt then answer, cut to max_len."""
    out = []
    for record in load_records():
        conv = record.get("conversations", [])
        if len(conv) < 2:
            continue
        ids = tokenizer(conv[0]["value"] + "\n" + conv[1]["value"]).input_ids[:max_len]
        if len(ids) >= 64:
            out.append(ids)
        if len(out) == n:
            return out
    return out


def prompt_logprobs(llm, token_lists) -> list[list[dict]]:
    from jaxpaged import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in token_lists], params,
                        use_tqdm=False)
    return [[{t: lp.logprob for t, lp in row.items()} for row in o.prompt_logprobs[1:]]
            for o in outs]


def kl_and_mass(ref_rows, rows) -> tuple[list[float], list[float]]:
    kls, masses = [], []
    for ref_seq, seq in zip(ref_rows, rows):
        for ref, q in zip(ref_seq, seq):
            top = sorted(ref.items(), key=lambda kv: -kv[1])[:20]
            floor = min(sorted(q.values(), reverse=True)[:20])
            kls.append(sum(math.exp(lp) * (lp - q.get(t, floor)) for t, lp in top))
            masses.append(sum(math.exp(lp) for _, lp in top))
    return kls, masses


def perplexity(rows, token_lists) -> float:
    logprobs = [row[t] for seq, ids in zip(rows, token_lists) for row, t in zip(seq, ids[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy(llm, prompts) -> list[list[int]]:
    from jaxpaged import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def tpot_batch1(llm, prompt: str, tokens: int = 128) -> float:
    """Seconds per output token after the first, one sequence, median of 3."""
    from jaxpaged import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # compiles
    times = []
    for _ in range(3):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        m = out.metrics
        times.append((m.finished_time - m.first_token_time) / (tokens - 1))
    return statistics.median(times)


def resident_memory(mode: str, model) -> int:
    """VmRSS in bytes of a fresh process that built `mode`'s engine and generated once."""
    code = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from quality import engine_options
from jaxpaged import LLM, SamplingParams
import argparse
args = argparse.Namespace(max_len=512)
llm = LLM(**engine_options({mode!r}, {model!r}, args), kv_cache_memory_bytes=64 << 20)
llm.generate(["Hello"], SamplingParams(max_tokens=8), use_tqdm=False)
rss = [l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]
print(json.dumps(int(rss) * 1024))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local HF folder; default: embedded SmolLM2")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512, help="teacher-forced tokens per text")
    p.add_argument("--out", type=Path, default=RESULTS / "quality.json")
    args = p.parse_args(argv)

    from jaxpaged import LLM

    results, ref_rows, ref_greedy, texts = {}, None, None, None
    modes = ["float32"] + [m for m in args.modes if m != "float32"]
    for mode in modes:
        start = time.perf_counter()
        llm = LLM(**engine_options(mode, args.model, args))
        if texts is None:
            texts = teacher_forced(llm.get_tokenizer(), args.num_prompts, args.max_len)
        rows = prompt_logprobs(llm, texts)
        ids = greedy(llm, GOLDEN_PROMPTS)
        stats = llm.stats()
        r = {"weight_bytes": stats["weight_bytes"],
             "kv_cache_bytes_per_token": stats["kv_cache_bytes_per_token"],
             "perplexity": perplexity(rows, texts),
             "tpot_batch1_s": tpot_batch1(llm, GOLDEN_PROMPTS[2])}
        if ref_rows is None:
            ref_rows, ref_greedy = rows, ids
        else:
            kls, masses = kl_and_mass(ref_rows, rows)
            agree = []
            for a, b in zip(ref_greedy, ids):
                n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                agree.append(n / len(a))
            r.update(mean_kl=statistics.fmean(kls), max_kl=max(kls),
                     top20_mass=statistics.fmean(masses),
                     greedy_agreement=statistics.fmean(agree))
        del llm
        r["resident_bytes"] = resident_memory(mode, args.model)
        r["wall_s"] = time.perf_counter() - start
        results[mode] = r
        print(mode, json.dumps(r), flush=True)
    base = results["float32"]
    for r in results.values():
        r["weight_bytes_vs_float32"] = r["weight_bytes"] / base["weight_bytes"]
        r["kv_bytes_vs_float32"] = r["kv_cache_bytes_per_token"] / base["kv_cache_bytes_per_token"]
        r["tpot_batch1_vs_float32"] = r["tpot_batch1_s"] / base["tpot_batch1_s"]
        r["resident_vs_float32"] = r["resident_bytes"] / base["resident_bytes"]
    report = {"config": {"model": args.model or "default", "num_texts": len(texts),
                         "max_len": args.max_len,
                         "num_teacher_forced_tokens": sum(len(t) - 1 for t in texts)},
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'mode':10} {'w bytes':>8} {'kv B/tok':>8} {'TPOT b1':>8} {'mean KL':>8} "
          f"{'max KL':>7} {'ppl':>6} {'greedy':>6} {'RSS':>6}")
    for mode, r in results.items():
        print(f"{mode:10} {r['weight_bytes_vs_float32']:8.3f} {r['kv_bytes_vs_float32']:8.3f} "
              f"{r['tpot_batch1_vs_float32']:8.3f} {r.get('mean_kl', 0):8.4f} "
              f"{r.get('max_kl', 0):7.3f} {r['perplexity']:6.2f} "
              f"{r.get('greedy_agreement', 1):6.2f} {r['resident_vs_float32']:6.2f}")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
