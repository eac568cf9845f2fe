"""Online serving benchmark, in the manner of vLLM's benchmark_serving: ShareGPT requests sent to
an OpenAI-compatible server with Poisson arrivals, streamed, timed per token.

    python bench/serving.py --num-prompts 50 --request-rate 1 --max-concurrency 16
    python bench/serving.py --backends jaxpaged,hf-serve     # and transformers' own server
    python bench/serving.py --base-url http://127.0.0.1:8000 # a server that is already up
    python bench/serving.py --sweep --backends jaxpaged,hf-serve   # the concurrency sweep

`--sweep` starts each server once and runs every level of a grid: datasets `random` (synthetic
prompts of --input-len tokens, --output-len tokens out, as vLLM's random dataset: random token
ids decoded to text) and `sharegpt`, temperatures 1.0 and 0, concurrency 1, 8 and 32 (all
requests sent at once, at most that many in flight; 2 x concurrency requests, at least 8, per
level, none shared between levels, so no level meets another's prompts in a prefix cache). It
writes bench/results/serving-sweep.json and a PNG of output throughput and p99 ITL against
concurrency.

Each backend is started as a subprocess on a free port (`jaxpaged serve`; `transformers serve
--continuous-batching` for `hf-serve`, which needs `pip install fastapi`), warmed up with a few
requests, sent the same request set (written to bench/results/serving-requests.jsonl), and
stopped. Requests go to `/v1/completions` with `stream: true`, at --temperature (1.0 by
default, what a client that sends none gets from vLLM and OpenAI), `max_tokens` = the
ShareGPT reply's length (capped by --max-output) and `ignore_eos` (not sent to `hf-serve`, which
rejects the field: it may stop earlier at EOS; output tokens are counted as generated, from the
usage chunk or by tokenizing the streamed text).

Reports per backend, as JSON in bench/results/serving.json with a table printed last: TTFT (time
to first token), TPOT (time per output token after the first, per request), ITL (inter-token
latency: time between streamed chunks) and E2EL (end-to-end latency), each as mean, median and
p99 in milliseconds; request and token throughput; and the ratio of jaxpaged to each peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import portable_config  # noqa: E402
from sharegpt import sample_requests  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "serving.json"


# -- one request ------------------------------------------------------------------------------

async def send(client: httpx.AsyncClient, url: str, model: str, request: dict, tokenizer,
               extra: dict) -> dict:
    """Streams one completion; returns its timings (seconds) and token counts. `extra` holds
    the body's sampling fields (temperature) and any backend-specific ones."""
    body = {"model": model, "prompt": request["prompt"], "max_tokens": request["output_len"],
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    start = time.perf_counter()
    chunk_times, text, usage = [], "", None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False, "error": (await response.aread()).decode()[:200]}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                usage = data.get("usage") or usage
                delta = "".join(c.get("text") or "" for c in data.get("choices", []))
                if delta:
                    chunk_times.append(time.perf_counter())
                    text += delta
    except httpx.HTTPError as e:
        return {"ok": False, "error": repr(e)}
    end = time.perf_counter()
    if not chunk_times:
        return {"ok": False, "error": "no text streamed"}
    output_tokens = (usage["completion_tokens"] if usage
                     else len(tokenizer(text, add_special_tokens=False).input_ids))
    ttft = chunk_times[0] - start
    return {"ok": True, "ttft": ttft, "e2el": end - start, "output_tokens": output_tokens,
            "prompt_tokens": request["prompt_len"], "itl": np.diff(chunk_times).tolist(),
            "tpot": (end - start - ttft) / (output_tokens - 1) if output_tokens > 1 else None}


async def replay(url: str, model: str, requests: list[dict], rate: float, max_concurrency: int,
                 seed: int, tokenizer, extra: dict) -> tuple[list[dict], float]:
    """Sends the requests with exponential inter-arrival gaps (a Poisson process of `rate`
    requests/s; `inf` sends all at once), at most `max_concurrency` in flight."""
    gaps = (np.zeros(len(requests)) if rate == float("inf")
            else np.random.default_rng(seed).exponential(1 / rate, len(requests)))
    limit = asyncio.Semaphore(max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=httpx.Limits(
            max_connections=max_concurrency, max_keepalive_connections=max_concurrency)) as client:
        async def limited(request):
            async with limit:
                return await send(client, url, model, request, tokenizer, extra)

        start = time.perf_counter()
        tasks = []
        for request, gap in zip(requests, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[dict], duration: float) -> dict:
    ok = [r for r in results if r["ok"]]
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration}
    if not ok:
        return out
    output_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] for r in ok)
    out.update(request_throughput=len(ok) / duration, output_throughput=output_tokens / duration,
               total_token_throughput=(prompt_tokens + output_tokens) / duration,
               total_output_tokens=output_tokens, total_prompt_tokens=prompt_tokens)
    series = {"ttft": [r["ttft"] for r in ok], "e2el": [r["e2el"] for r in ok],
              "tpot": [r["tpot"] for r in ok if r["tpot"] is not None],
              "itl": [x for r in ok for x in r["itl"]]}
    for name, values in series.items():
        values = np.asarray(values or [np.nan]) * 1000
        out[f"mean_{name}_ms"] = float(np.mean(values))
        out[f"median_{name}_ms"] = float(np.median(values))
        out[f"p99_{name}_ms"] = float(np.percentile(values, 99))
    return out


# -- servers ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(backend: str, model_dir: Path, port: int, args) -> list[str]:
    if backend == "jaxpaged":
        return [sys.executable, "-m", "jaxpaged.entrypoints.cli", "serve", "--model", str(model_dir),
                "--port", str(port), "--max-model-len", str(args.max_model_len),
                "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"] + [
                    arg for name in ("long_prefill_token_threshold", "max_num_partial_prefills")
                    if getattr(args, name) is not None
                    for arg in ("--" + name.replace("_", "-"), str(getattr(args, name)))]
    if backend == "hf-serve":
        exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or "transformers"
        return [exe, "serve", str(model_dir), "--continuous-batching", "--device", "cpu",
                "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1"]
    raise SystemExit(f"unknown backend {backend!r}: use jaxpaged or hf-serve")


def wait_until_up(url: str, process: subprocess.Popen | None, timeout: float = 600) -> str:
    """The served model's name, once `GET /v1/models` answers."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            return httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, ValueError):
            if time.monotonic() > deadline:
                raise SystemExit(f"no server at {url} after {timeout} s") from None
            time.sleep(1)


class Server:
    """A backend's server for the duration of a `with` block (nothing started for a URL)."""

    def __init__(self, backend: str, url: str | None, args):
        self.backend, self.url, self.args, self.process = backend, url, args, None

    def __enter__(self):
        if self.url is None:
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.process = subprocess.Popen(
                server_command(self.backend, self.args.model_dir, port, self.args),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.model = wait_until_up(self.url, self.process)
        return self

    def __exit__(self, *exc):
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=60)

    def run(self, requests, rate: float, max_concurrency: int, temperature: float,
            tokenizer) -> dict:
        """One replay of `requests`, summarized."""
        # transformers serve rejects fields it does not know, such as vLLM's ignore_eos.
        extra = {"temperature": temperature}
        if self.backend != "hf-serve":
            extra["ignore_eos"] = True
        results, duration = asyncio.run(replay(self.url, self.model, requests, rate,
                                               max_concurrency, self.args.seed, tokenizer, extra))
        summary = summarize(results, duration)
        errors = [r["error"] for r in results if not r["ok"]]
        if errors:
            summary["first_error"] = errors[0]
        return summary


def bench_backend(backend: str, url: str | None, requests, warmup, args, tokenizer) -> dict:
    with Server(backend, url, args) as server:
        print(f"[{backend}] up at {server.url}; warming up with {len(warmup)} requests",
              flush=True)
        server.run(warmup, float("inf"), args.max_concurrency, args.temperature, tokenizer)
        print(f"[{backend}] {len(requests)} requests at {args.request_rate} req/s", flush=True)
        return server.run(requests, args.request_rate, args.max_concurrency, args.temperature,
                          tokenizer)


# -- the concurrency sweep --------------------------------------------------------------------

def random_requests(tokenizer, num: int, input_len: int, output_len: int, seed: int):
    """vLLM's random dataset: `input_len` uniform random token ids decoded to text (its length
    re-measured by tokenizing), `output_len` tokens out."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num):
        prompt = tokenizer.decode(rng.integers(100, tokenizer.vocab_size, input_len).tolist())
        requests.append({"prompt": prompt, "output_len": output_len,
                         "prompt_len": len(tokenizer(prompt).input_ids)})
    return requests


def level_sizes(args) -> list[int]:
    """Requests per level: 2 x its concurrency, at least 8; each level gets requests of its
    own, so that no level finds another's prompts in the prefix cache."""
    return [max(8, 2 * c) for c in args.concurrency] * len(args.temperatures)


def sweep(backends: list[str], datasets: dict, args, tokenizer) -> dict:
    """{backend: {"<dataset>/t<temperature>/c<concurrency>": summary}}, each server started
    once; each dataset's warmup requests go first."""
    out = {}
    for backend in backends:
        out[backend] = {}
        with Server(backend, args.base_url, args) as server:
            for name, (warmup, requests) in datasets.items():
                server.run(warmup, float("inf"), 8, 1.0, tokenizer)
                start = 0
                for temperature in args.temperatures:
                    for c in args.concurrency:
                        level, n = f"{name}/t{temperature:g}/c{c}", max(8, 2 * c)
                        print(f"[{backend}] {level}", flush=True)
                        out[backend][level] = server.run(requests[start:start + n], float("inf"),
                                                         c, temperature, tokenizer)
                        start += n
    return out


def sweep_main(args, tokenizer, sharegpt_requests) -> None:
    n = sum(level_sizes(args)) + args.num_warmup
    datasets = {}
    if "random" in args.datasets:
        synthetic = random_requests(tokenizer, n, args.input_len, args.output_len, args.seed)
        datasets["random"] = (synthetic[:args.num_warmup], synthetic[args.num_warmup:])
    if "sharegpt" in args.datasets:
        datasets["sharegpt"] = sharegpt_requests
    backends = ["server"] if args.base_url else args.backends.split(",")
    report = {"config": portable_config(args), "machine": {"cpus": os.cpu_count()},
              "levels": sweep(backends, datasets, args, tokenizer)}
    jp = report["levels"].get("jaxpaged", {})
    report["ratios"] = {
        f"jaxpaged/{peer}": {level: _ratios(jp[level], r[level]) for level in jp
                             if level in r and r[level].get("completed")
                             and jp[level].get("completed")}
        for peer, r in report["levels"].items() if peer != "jaxpaged" and jp}
    out = args.out if args.out != DEFAULT_OUT else RESULTS / "serving-sweep.json"
    out.write_text(json.dumps(report, indent=2))
    plot_sweep(report, args, out.with_suffix(".png"))
    print_sweep(report)
    print(f"wrote {out}")


def _ratios(mine: dict, peer: dict) -> dict:
    return {"output_throughput": mine["output_throughput"] / peer["output_throughput"],
            "median_ttft": mine["median_ttft_ms"] / peer["median_ttft_ms"],
            "median_tpot": mine["median_tpot_ms"] / peer["median_tpot_ms"]}


def print_sweep(report: dict) -> None:
    stats = [("out tok/s", "output_throughput", "{:.1f}")] + [
        (f"{s} {m.upper()}", f"{s}_{m}_ms", "{:.0f}")
        for m in ("ttft", "tpot", "itl") for s in ("median", "p99")]
    print(f"{'backend':10} {'level':20}" + "".join(f"{label:>13}" for label, _, _ in stats)
          + f"{'done':>6}")
    for backend, levels in report["levels"].items():
        for level, r in levels.items():
            cells = [r.get(key) for _, key, _ in stats]
            print(f"{backend:10} {level:20}" + "".join(
                f"{fmt.format(c) if c is not None else '-':>13}"
                for c, (_, _, fmt) in zip(cells, stats)) + f"{r['completed']:>6}")
    print("(latencies in ms)")


def plot_sweep(report: dict, args, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no PNG: pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for backend, levels in report["levels"].items():
        for dataset in args.datasets:
            for temperature, style in zip(args.temperatures, ("-", ":", "--")):
                keys = [f"{dataset}/t{temperature:g}/c{c}" for c in args.concurrency]
                rows = [levels.get(k, {}) for k in keys]
                label = f"{backend} {dataset} t={temperature:g}"
                for ax, key in zip(axes, ("output_throughput", "p99_itl_ms")):
                    ax.plot(args.concurrency, [r.get(key, np.nan) for r in rows], style,
                            marker="o", label=label)
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("p99 inter-token latency (ms)")
    for ax in axes:
        ax.set_xlabel("concurrent requests")
        ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="jaxpaged", help="comma-separated: jaxpaged, hf-serve")
    p.add_argument("--base-url", default=None,
                   help="bench this running server instead of starting the backends")
    p.add_argument("--model", default=None, help="local HF folder; default: embedded SmolLM2")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--num-warmup", type=int, default=4)
    p.add_argument("--request-rate", type=float, default=1.0, help="requests/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--max-output", type=int, default=128, help="cap on each output length")
    p.add_argument("--max-prompt", type=int, default=1024, help="cap on each prompt length")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--sweep", action="store_true",
                   help="the concurrency sweep (random and ShareGPT, temperature 1 and 0, "
                   "concurrency 1, 8, 32) instead of one replay")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32],
                   help="sweep: concurrency levels")
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0],
                   help="sweep: temperatures")
    p.add_argument("--datasets", nargs="+", default=["random", "sharegpt"],
                   choices=["random", "sharegpt"], help="sweep: datasets")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="jaxpaged's prefill cap while decoding (default: the engine's)")
    p.add_argument("--max-num-partial-prefills", type=int, default=None,
                   help="jaxpaged's prompts per step while decoding (default: the engine's)")
    p.add_argument("--input-len", type=int, default=256, help="sweep, random: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="sweep, random: output tokens")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="JSON report; default bench/results/serving.json (serving-sweep.json "
                   "with --sweep)")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from jaxpaged.model_loader.model_store import resolve_model

    args.model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    if args.sweep:  # every level has requests of its own
        args.num_prompts = max(args.num_prompts, sum(level_sizes(args)))
    sampled = [(prompt, n, min(out, args.max_output)) for prompt, n, out in
               sample_requests(tokenizer, args.num_prompts + args.num_warmup, args.seed)
               if n <= args.max_prompt]
    all_requests = [{"prompt": prompt, "prompt_len": n, "output_len": out}
                    for prompt, n, out in sampled]
    warmup, requests = all_requests[:args.num_warmup], all_requests[args.num_warmup:]
    RESULTS.mkdir(exist_ok=True)
    if args.sweep:
        return sweep_main(args, tokenizer, (warmup, requests))
    with open(RESULTS / "serving-requests.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in requests)

    backends = ["server"] if args.base_url else args.backends.split(",")
    report = {"config": portable_config(args),
              "machine": {"cpus": os.cpu_count()}, "backends": {}}
    for backend in backends:
        report["backends"][backend] = bench_backend(backend, args.base_url, requests, warmup,
                                                    args, tokenizer)
    jp = report["backends"].get("jaxpaged")
    report["ratios"] = {
        f"jaxpaged/{peer}": _ratios(jp, r) for peer, r in report["backends"].items()
        if jp and peer != "jaxpaged" and r.get("completed") and jp.get("completed")}
    args.out.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"wrote {args.out}")


def print_table(report: dict) -> None:
    rows = [("completed", "completed", "{:.0f}"), ("req/s", "request_throughput", "{:.3f}"),
            ("out tok/s", "output_throughput", "{:.1f}"),
            ("total tok/s", "total_token_throughput", "{:.1f}")]
    for name in ("ttft", "tpot", "itl", "e2el"):
        rows += [(f"{stat} {name.upper()} ms", f"{stat}_{name}_ms", "{:.1f}")
                 for stat in ("mean", "median", "p99")]
    names = list(report["backends"])
    print(f"{'':18}" + "".join(f"{n:>14}" for n in names))
    for label, key, fmt in rows:
        cells = [report["backends"][n].get(key) for n in names]
        print(f"{label:18}" + "".join(f"{fmt.format(c) if c is not None else '-':>14}"
                                      for c in cells))
    for pair, ratio in report["ratios"].items():
        print(f"{pair}: output tok/s x{ratio['output_throughput']:.2f}, median TTFT "
              f"x{ratio['median_ttft']:.2f}, median TPOT x{ratio['median_tpot']:.2f}")


if __name__ == "__main__":
    main()
