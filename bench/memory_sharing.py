"""KV blocks with and without memory sharing, for parallel sampling and beam search.

PagedAttention section 4.4 / figure 15: the n samples of a prompt share the prompt's blocks, and
beams share their common prefixes. For each ShareGPT prompt this runs the engine and records, at
every step, the blocks actually in use (shared blocks counted once) and the blocks the same
sequences would hold without sharing (each its own copy: the sum of their block-table lengths).
The saving is 1 - shared / unshared, over all steps of all prompts. JSON and a PNG bar chart go
to bench/results/.

    python bench/memory_sharing.py --num-prompts 8 --max-output 64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sharegpt import sample_requests

from jaxpaged import LLM, BeamSearchParams, SamplingParams
from jaxpaged.entrypoints.beam_search import beam_search

RESULTS = Path(__file__).resolve().parent / "results"


def usage(engine) -> tuple[int, int]:
    """(blocks in use, blocks the running sequences would hold unshared)."""
    return (engine.stats()["num_used_blocks"],
            sum(len(s.block_table) for s in engine.scheduler.running))


def parallel_sampling(llm, requests, n, max_output) -> tuple[int, int]:
    engine, used, unshared = llm.llm_engine, 0, 0
    for i, (prompt, _, output_len) in enumerate(requests):
        params = SamplingParams(n=n, temperature=1.0, seed=i, ignore_eos=True,
                                max_tokens=min(output_len, max_output))
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        u, w = usage(engine)
        used, unshared = used + u, unshared + w
    return used, unshared


def beam(llm, requests, width, max_output) -> tuple[int, int]:
    engine, totals = llm.llm_engine, [0, 0]

    def on_step(e):
        u, w = usage(e)
        totals[0] += u
        totals[1] += w

    for prompt, _, output_len in requests:
        ids = engine.tokenize_prompt(prompt)[1]
        beam_search(engine, ids, BeamSearchParams(width, min(output_len, max_output),
                                                  ignore_eos=True), on_step=on_step)
    return totals[0], totals[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-output", type=int, default=64, help="cap on each request's output")
    p.add_argument("--out", type=Path, default=RESULTS / "memory_sharing.json")
    args = p.parse_args(argv)

    llm = LLM(args.model, max_model_len=2048 + 16, num_kv_blocks=4096)
    requests = sample_requests(llm.get_tokenizer(), args.num_prompts)
    rows = []
    for kind, run in (("parallel sampling", parallel_sampling), ("beam search", beam)):
        for width in (2, 4, 6):
            start = time.perf_counter()
            used, unshared = run(llm, requests, width, args.max_output)
            rows.append({"kind": kind, "width": width, "blocks_used": used,
                         "blocks_unshared": unshared, "saving": 1 - used / unshared,
                         "seconds": time.perf_counter() - start})
            print(f"{kind:<18} width {width}: {rows[-1]['saving']:.1%} fewer blocks", flush=True)
    report = {"num_prompts": len(requests), "max_output": args.max_output,
              "mean_prompt_len": sum(r[1] for r in requests) / len(requests),
              "block_size": llm.llm_engine.cache_config.block_size, "rows": rows,
              "note": "blocks summed over every step (block-steps), shared vs each sequence "
                      "holding its own copy"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(rows, args.out.with_suffix(".png"))
    print(f"\n{'kind':<18} {'width':>5} {'used':>10} {'unshared':>10} {'saving':>8}")
    for r in rows:
        print(f"{r['kind']:<18} {r['width']:>5} {r['blocks_used']:>10} "
              f"{r['blocks_unshared']:>10} {r['saving']:>8.1%}")


def plot(rows, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, kind in zip(axes, ("parallel sampling", "beam search")):
        sel = [r for r in rows if r["kind"] == kind]
        ax.bar([str(r["width"]) for r in sel], [100 * r["saving"] for r in sel])
        ax.set_title(kind)
        ax.set_xlabel("n" if kind == "parallel sampling" else "beam width")
    axes[0].set_ylabel("KV blocks saved by sharing (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
