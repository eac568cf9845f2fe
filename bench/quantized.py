"""8-bit serving against float32 and against llama.cpp, on the same GGUF files, in one run.

    python bench/quantized.py                        # every engine below
    python bench/quantized.py --engines jaxpaged-w8a8 llama.cpp-q8_0

The default model (the embedded SmolLM2, as a Hugging Face folder) is converted with
llama.cpp's `convert_hf_to_gguf.py` to a float32 GGUF and quantized with `llama-quantize` to
Q8_0 (`bench/llamacpp.py`, which also builds llama.cpp from source; both cached outside the
repository). Engines, each on one of those two files:

  llama.cpp-f32     llama-server on the f32 file, 32 slots (`-np 32`), 2 threads (`-t 2`)
  llama.cpp-q8_0    the same on the Q8_0 file
  jaxpaged-float32  LLM(model=f32 file, quantization=None), max_num_seqs 32
  jaxpaged-int8     LLM(model=Q8_0 file, quantization="int8"): weight-only int8
  jaxpaged-w8a8     LLM(model=Q8_0 file, quantization="w8a8"): int8 activations too
  jaxpaged-q8_0     LLM(model=Q8_0 file, quantization="q8_0"): the file's Q8_0 blocks as they are
  jaxpaged-default  LLM(model=Q8_0 file): what a GGUF file gets by default
  jaxpaged-default-kv8  the same with an int8 KV pool (`kv_cache_dtype="int8"`)

Workload: the 64-prompt ShareGPT set (vLLM's filter, seed 0, outputs capped at 256 tokens),
greedy, EOS ignored, prompts sent as token ids so both engines see the same tokens; at most 32
requests in flight for llama-server, all 64 given to `LLM.generate` at once (32 run at a
time). Output tokens/s over the whole set. Batch-1 TPOT: one request alone, (time for 129
tokens - time for 1 token) / 128, median of 3, measured the same way on both engines (HTTP
round trips for llama-server, `LLM.generate` for jaxpaged). jaxpaged compiles its step shapes
before the timed pass (`precompile=True`); llama-server's warm-up runs at its start. `LLM`
decodes 8 steps a call by default (`num_scheduler_steps`), so plain greedy decoding (this
workload) reads its draws back once per 8 tokens; `--tpot-rounds` also times it with 1.

Writes bench/results/quantized.json (ratios against llama.cpp's Q8_0 and against jaxpaged's
float32) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import llamacpp  # noqa: E402
from sharegpt import sample_requests  # noqa: E402

RESULTS = BENCH / "results"
ENGINES = ["llama.cpp-f32", "llama.cpp-q8_0", "jaxpaged-float32", "jaxpaged-int8",
           "jaxpaged-w8a8", "jaxpaged-q8_0", "jaxpaged-default", "jaxpaged-default-kv8"]
SLOTS = 32
TPOT_TOKENS = 128
# The jaxpaged engines of the paired batch-1 TPOT (`--tpot-rounds`): name -> `LLM` options.
# The default decodes 8 steps a call (`num_scheduler_steps`); 1 is each step its own call.
TPOT_VARIANTS = {"jaxpaged-default": {},
                 "jaxpaged-num_scheduler_steps=1": dict(num_scheduler_steps=1)}


def requests_for(tokenizer, num_prompts: int, max_output: int) -> list[dict]:
    return [{"prompt_token_ids": tokenizer(prompt).input_ids,
             "output_len": min(output_len, max_output)}
            for prompt, _, output_len in sample_requests(tokenizer, num_prompts, 0)]


# -- llama.cpp --------------------------------------------------------------------------------

class LlamaServer:
    """`llama-server` on `model`, `SLOTS` slots of `ctx` tokens each, on a free local port."""

    def __init__(self, bin_dir: Path, model: Path, ctx: int, threads: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.TemporaryFile("w+")  # a pipe nobody reads would fill and block it
        self.proc = subprocess.Popen(
            [str(bin_dir / "llama-server"), "-m", str(model), "-np", str(SLOTS),
             "-c", str(SLOTS * ctx), "-t", str(threads), "-tb", str(threads),
             "--host", "127.0.0.1", "--port", str(self.port), "--no-webui"],
            stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        import httpx

        self.client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=SLOTS))
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"llama-server exited: {self.log.read()[-2000:]}")
            try:
                if self.client.get(f"{self.url}/health").status_code == 200:
                    return
            except Exception:
                pass
            time.sleep(0.5)
        raise TimeoutError("llama-server did not become healthy in 300 s")

    def complete(self, ids: list[int], n: int) -> int:
        r = self.client.post(f"{self.url}/completion", json={
            "prompt": ids, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
            "cache_prompt": False, "samplers": ["top_k"], "top_k": 1})
        r.raise_for_status()
        return int(r.json()["tokens_predicted"])

    def close(self):
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def run_llama_cpp(bin_dir: Path, model: Path, requests: list[dict], threads: int) -> dict:
    ctx = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests) + 8
    start = time.perf_counter()
    server = LlamaServer(bin_dir, model, ctx, threads)
    startup = time.perf_counter() - start
    try:
        server.complete(requests[0]["prompt_token_ids"], 8)  # one untimed request
        start = time.perf_counter()
        with ThreadPoolExecutor(SLOTS) as pool:
            counts = list(pool.map(lambda r: server.complete(r["prompt_token_ids"],
                                                             r["output_len"]), requests))
        elapsed = time.perf_counter() - start
        assert counts == [r["output_len"] for r in requests], "llama-server stopped early"
        tpot = tpot_batch1(lambda ids, n: server.complete(ids, n), requests[0])
    finally:
        server.close()
    return {"elapsed_s": elapsed, "output_tokens": sum(counts),
            "output_tokens_per_s": sum(counts) / elapsed, "tpot_batch1_s": tpot,
            "startup_s": startup}


# -- jaxpaged ---------------------------------------------------------------------------------

def run_jaxpaged(model: Path, quantization, requests: list[dict],
                 kv_cache_dtype: str = "auto") -> dict:
    from jaxpaged import LLM, SamplingParams

    max_len = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests)
    options = {} if quantization == "default" else {"quantization": quantization}
    options["kv_cache_dtype"] = kv_cache_dtype
    start = time.perf_counter()
    llm = LLM(str(model), max_model_len=max(max_len, 2048), max_num_seqs=SLOTS,
              precompile=True, **options)
    startup = time.perf_counter() - start
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True)
              for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)

    def complete(ids, n):
        llm.generate([{"prompt_token_ids": ids}],
                     SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)

    tpot = tpot_batch1(complete, requests[0])
    resolved = llm.llm_engine.quantization
    return {"elapsed_s": elapsed, "output_tokens": tokens,
            "output_tokens_per_s": tokens / elapsed, "tpot_batch1_s": tpot,
            "startup_s": startup, "quantization": resolved, "kv_cache_dtype": kv_cache_dtype}


def tpot_batch1(complete, request: dict, repeats: int = 3) -> float:
    """(time of a (TPOT_TOKENS + 1)-token completion - time of a 1-token one) / TPOT_TOKENS,
    each the median of `repeats`, the request alone."""
    ids = request["prompt_token_ids"]
    complete(ids, 2)  # warm

    def timed(n):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            complete(ids, n)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return (timed(TPOT_TOKENS + 1) - timed(1)) / TPOT_TOKENS


def paired_tpot(bin_dir: Path, model: Path, requests: list[dict], threads: int,
                rounds: int, variants: dict[str, dict]) -> dict:
    """Batch-1 TPOT of llama-server and of jaxpaged engines on the same file (`variants`: name
    -> `LLM` options over the defaults), all alive at once and measured in turns (`tpot_batch1`
    each, the order rotated every round), so that the machine's drift over a run (20% here
    between runs minutes apart) falls on all alike."""
    from jaxpaged import LLM, SamplingParams

    max_len = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests)

    def jaxpaged(options):
        llm = LLM(str(model), max_model_len=max(max_len, 2048), max_num_seqs=SLOTS,
                  precompile=True, **options)
        return lambda ids, n: llm.generate(
            [{"prompt_token_ids": ids}],
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    engines = [(name, jaxpaged(options)) for name, options in variants.items()]
    ctx = len(requests[0]["prompt_token_ids"]) + TPOT_TOKENS + 8
    server = LlamaServer(bin_dir, model, ctx, threads)
    engines.insert(0, ("llama.cpp-q8_0", server.complete))
    times = {name: [] for name, _ in engines}
    try:
        for r in range(rounds):
            for name, complete in engines[r % len(engines):] + engines[:r % len(engines)]:
                times[name].append(tpot_batch1(complete, requests[0]))
    finally:
        server.close()
    llama = times["llama.cpp-q8_0"]
    return {"rounds": rounds, "options": variants, "tpot_batch1_s": times,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "speed / llama.cpp's (llama.cpp's TPOT / the engine's: > 1: the engine faster)": {
                name: statistics.median(llama) / statistics.median(times[name])
                for name in variants},
            "rounds the engine was faster than llama.cpp": {
                name: sum(o < t for o, t in zip(times[name], llama)) for name in variants}}


# -- the run ----------------------------------------------------------------------------------

def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="*", default=ENGINES, choices=ENGINES)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                   help="llama-server's threads (jaxpaged uses XLA's pool: every core)")
    p.add_argument("--tpot-rounds", type=int, default=0,
                   help="then batch-1 TPOT of llama.cpp Q8_0 and jaxpaged's default in turns, "
                        "this many rounds (`paired_tpot`)")
    p.add_argument("--out", type=Path, default=RESULTS / "quantized.json")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from jaxpaged.model_loader.model_store import default_model_dir
    from jaxpaged.pallas_kernels import cpu_attention
    from jaxpaged.platforms import current_platform

    folder = default_model_dir()
    files = llamacpp.convert(folder, llamacpp.cache_dir() / "models" / folder.name)
    bin_dir = llamacpp.build()
    requests = requests_for(AutoTokenizer.from_pretrained(folder), args.num_prompts,
                            args.max_output)
    current_platform()
    results = {}
    for engine in args.engines:
        kind, _, mode = engine.partition("-")
        if kind == "llama.cpp":
            results[engine] = run_llama_cpp(bin_dir, files[mode], requests, args.threads)
        else:
            model = files["f32"] if mode == "float32" else files["q8_0"]
            mode, _, kv = mode.partition("-kv")
            results[engine] = run_jaxpaged(model, None if mode == "float32" else mode, requests,
                                           kv_cache_dtype="int8" if kv == "8" else "auto")
        results[engine]["file"] = files["f32" if mode in ("f32", "float32") else "q8_0"].name
        print(engine, json.dumps(results[engine]), flush=True)
    ratios = {}
    for peer in ("llama.cpp-q8_0", "jaxpaged-float32", "llama.cpp-f32"):
        if peer not in results:
            continue
        for engine, r in results.items():
            if engine != peer:
                ratios[f"{engine} / {peer}"] = {
                    "output_tokens_per_s": r["output_tokens_per_s"]
                    / results[peer]["output_tokens_per_s"],
                    "tpot_batch1 (peer / engine: > 1 is faster)":
                    results[peer]["tpot_batch1_s"] / r["tpot_batch1_s"]}
    report = {"config": {"model": "default (SmolLM2-135M-Instruct)",
                         "num_prompts": len(requests), "max_output": args.max_output,
                         "slots": SLOTS, "llama_server_threads": args.threads,
                         "llama_cpp_source": llamacpp.source_dir().parent.name,
                         "cpu": platform.processor() or platform.machine(),
                         "w8a8_kernel_isa": cpu_attention.w8a8_isa(),
                         "total_output_tokens": sum(r["output_len"] for r in requests)},
              "results": results, "ratios": ratios}
    if args.tpot_rounds:
        report["tpot_paired"] = paired_tpot(bin_dir, files["q8_0"], requests, args.threads,
                                            args.tpot_rounds, TPOT_VARIANTS)
        print("paired batch-1 TPOT", json.dumps(report["tpot_paired"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'engine':18} {'file':18} {'out tok/s':>9} {'TPOT b1 ms':>10}")
    for engine, r in results.items():
        print(f"{engine:18} {r['file']:18} {r['output_tokens_per_s']:9.1f} "
              f"{1e3 * r['tpot_batch1_s']:10.2f}")
    for name, r in ratios.items():
        print(f"{name:40} tok/s {r['output_tokens_per_s']:.2f}x  "
              f"TPOT {r['tpot_batch1 (peer / engine: > 1 is faster)']:.2f}x")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
