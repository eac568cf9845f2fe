"""Offline throughput of this checkout against an older commit, on one machine in one run.

    python bench/against_commit.py                       # against 6cc86b0, 64 ShareGPT prompts
    python bench/against_commit.py --commit a564367 --rounds 3

Each side is built from git (`git worktree` of the commit, and of HEAD: committed code only)
and installed with pip into its own folder, then timed in fresh processes that alternate
(old, new, old, new, ...) so that a drift of the machine falls on both. Every process replays
the same requests (`bench/results/throughput-smollm2.requests.jsonl` by default, as
`bench/throughput.py` writes them: ShareGPT prompts with their reference output lengths, EOS
ignored), greedy, through the public API both sides share:
`LLM(max_model_len=..., max_num_seqs=..., precompile=True)` and one `generate` call, which is
timed (startup and compiles are not). By default the workload first runs once untimed
(`--no-warmup` to skip it): on CPU an executable's first run costs 0.1-0.5 s more than later
ones, and a warm start of this checkout loads its cached executables when a step first needs
them (about 0.2 s each), which older commits did at startup. Output tokens per second per run,
the best and the median of each side and their ratios go to bench/results/against-<commit>.json,
with each run's batch-1 TPOT at the default steps per call (`--no-tpot` to skip it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import REPO, portable, portable_config  # noqa: E402

DEFAULT_REQUESTS = REPO / "bench" / "results" / "throughput-smollm2.requests.jsonl"


def child(args) -> None:
    """Runs in a fresh process with one side's jaxpaged on sys.path; prints one JSON line."""
    import jaxpaged
    from jaxpaged import LLM, SamplingParams

    requests = [json.loads(line) for line in args.requests.read_text().splitlines() if line]
    max_len = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests)
    llm = LLM(max_model_len=max(max_len, args.max_model_len), max_num_seqs=args.max_num_seqs,
              precompile=True)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True)
              for r in requests]
    if args.warmup:  # every executable the workload runs has run once (see the docstring)
        llm.generate(prompts, params, use_tqdm=False)
        llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_output = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_output == sum(r["output_len"] for r in requests)
    result = {"jaxpaged": str(Path(jaxpaged.__file__).parent), "elapsed_s": elapsed,
              "output_tokens_per_s": num_output / elapsed}
    if args.tpot:
        result["tpot_batch1_s"] = tpot_batch1(llm, requests[0]["prompt_token_ids"])
    print(json.dumps(result))


def tpot_batch1(llm, ids: list[int], tokens: int = 128, repeats: int = 3) -> float:
    """Batch-1 TPOT in seconds at the engine's default steps per call: (time of a
    (tokens + 1)-token completion - time of a 1-token one) / tokens, each the median of
    `repeats`, the request alone, greedy, EOS ignored."""
    from jaxpaged import SamplingParams

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    timed(2)  # warm
    return (timed(tokens + 1) - timed(1)) / tokens


def install(commit: str, into: Path) -> str:
    """Installs `commit`'s jaxpaged (dependencies as this environment has them) into `into`;
    returns the full commit id."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", commit], check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = into.parent / f"src-{sha[:12]}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), sha],
                   check=True, capture_output=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-build-isolation", "--target", str(into), str(tree)], check=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                       check=True, capture_output=True)
    return sha


def run_side(target: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(target))
    cmd = [sys.executable, __file__, "--child", "--requests", str(args.requests),
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
           "--warmup" if args.warmup else "--no-warmup", "--tpot" if args.tpot else "--no-tpot"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(result.pop("jaxpaged")).is_relative_to(target):  # the side's own code ran
        raise RuntimeError(f"the run under {target} imported another jaxpaged")
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commit", default="6cc86b0", help="the older commit")
    p.add_argument("--against", default="HEAD", help="the newer commit")
    p.add_argument("--requests", type=Path, default=DEFAULT_REQUESTS)
    p.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run the workload once untimed first")
    p.add_argument("--tpot", action=argparse.BooleanOptionalAction, default=True,
                   help="also time batch-1 TPOT in each run (`tpot_batch1`)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.requests = args.requests.resolve()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {}
        for name in (args.commit, args.against):
            target = Path(tmp) / f"site-{len(sides)}"
            sides[name] = {"commit": install(name, target), "target": target, "runs": []}
        for round_ in range(args.rounds):
            for name, side in sides.items():
                run = run_side(side["target"], args)
                side["runs"].append(run)
                print(f"round {round_ + 1} {name}: {run['output_tokens_per_s']:.1f} output tok/s"
                      + (f", TPOT {1e3 * run['tpot_batch1_s']:.2f} ms" if args.tpot else ""),
                      flush=True)
    results = {name: {"commit": side["commit"],
                      "output_tokens_per_s": [r["output_tokens_per_s"] for r in side["runs"]],
                      "best_output_tokens_per_s": max(r["output_tokens_per_s"]
                                                      for r in side["runs"])}
               for name, side in sides.items()}
    old, new = results[args.commit], results[args.against]
    for name, side in results.items():
        side["median_output_tokens_per_s"] = statistics.median(side["output_tokens_per_s"])
        if args.tpot:
            side["tpot_batch1_s"] = [r["tpot_batch1_s"] for r in sides[name]["runs"]]
            side["median_tpot_batch1_s"] = statistics.median(side["tpot_batch1_s"])
    report = {"config": portable_config(args),
              "results": results,
              "ratio_best": new["best_output_tokens_per_s"] / old["best_output_tokens_per_s"],
              "ratio_median": (new["median_output_tokens_per_s"]
                               / old["median_output_tokens_per_s"])}
    if args.tpot:  # > 1: the newer side's tokens come faster
        report["tpot_ratio_median (old / new)"] = (old["median_tpot_batch1_s"]
                                                   / new["median_tpot_batch1_s"])
    out = args.out or REPO / "bench" / "results" / f"against-{args.commit}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{args.against} / {args.commit}: {report['ratio_best']:.3f} best, "
          f"{report['ratio_median']:.3f} median (best {new['best_output_tokens_per_s']:.1f} vs "
          f"{old['best_output_tokens_per_s']:.1f} output tok/s); {portable(out)}")
    return report


if __name__ == "__main__":
    main()
