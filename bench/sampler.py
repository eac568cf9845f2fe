"""The sampler alone: one jitted call over R samples of the default model's vocabulary, per
sampling setting, against the full-sort sampler it replaced (in this file, as the peer).

    python bench/sampler.py                # R = 8, 32, 64; V = 49152
    python bench/sampler.py --rows 64 --vocab-size 151936

Logits are random normal times 3 (a peaked row, as a language model's), except for the
"top_p 0.95, flat" setting (normal times 0.5), whose nucleus is larger than the candidate set,
so its cutoff comes from the bisection. The peer sorts each row, masks it to top-k and the
top-p nucleus, and draws with `jax.random.categorical` (Gumbel-max over V noise values), as
jaxpaged's sampler did before (greedy batches: an argmax, as before). Reports milliseconds per call (best of --repeats) and the ratio
peer / jaxpaged, as JSON in bench/results/sampler.json with a table printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import portable_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = {  # name: (temperature, top_k, top_p, min_p, logits scale)
    "greedy": (0.0, 0, 1.0, 0.0, 3.0),
    "temperature 1.0": (1.0, 0, 1.0, 0.0, 3.0),
    "min_p 0.05": (1.0, 0, 1.0, 0.05, 3.0),
    "top_k 50, top_p 0.95": (1.0, 50, 0.95, 0.0, 3.0),
    "top_p 0.95": (1.0, 0, 0.95, 0.0, 3.0),
    "top_p 0.95, flat": (1.0, 0, 0.95, 0.0, 0.5),
}


@jax.jit
def full_sort_sample(logits, temperature, top_k, top_p, min_p, keys):
    """The peer: the sort-based truncation and Gumbel-max draw jaxpaged used before."""
    V = logits.shape[-1]
    x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    probs = jax.nn.softmax(x, axis=-1)
    x = jnp.where(probs >= min_p[:, None] * probs.max(-1, keepdims=True), x, -jnp.inf)
    desc = -jnp.sort(-x, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    rank = jnp.arange(V)[None, :]
    desc = jnp.where(rank < k[:, None], desc, -jnp.inf)
    p = jax.nn.softmax(desc, axis=-1)
    num_kept = jnp.sum((jnp.cumsum(p, axis=-1) - p < top_p[:, None]) & (rank < k[:, None]), -1)
    cutoff = jnp.take_along_axis(desc, (num_kept - 1)[:, None], axis=-1)
    x = jnp.where(x >= cutoff, x, -jnp.inf)
    drawn = jax.vmap(jax.random.categorical)(keys, x)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, -1))


@jax.jit
def argmax_sample(logits):
    """The peer for greedy batches: the earlier sampler took the argmax alone there too."""
    return jnp.argmax(logits, -1)


def best_ms(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def main(argv=None) -> dict:
    from jaxpaged.sample.sampler import SamplingMetadata, num_candidates, sample_jit

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64], help="samples R")
    p.add_argument("--vocab-size", type=int, default=49152, help="V (SmolLM2's by default)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=RESULTS / "sampler.json")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    results = []
    for R in args.rows:
        normal = rng.standard_normal((R, args.vocab_size)).astype(np.float32)
        for name, (temperature, top_k, top_p, min_p, scale) in SETTINGS.items():
            logits = jnp.asarray(normal * scale)
            full = lambda v, dtype: np.full((R,), v, dtype)
            md = SamplingMetadata(
                temperature=full(temperature, np.float32), top_k=full(top_k, np.int32),
                top_p=full(top_p, np.float32), min_p=full(min_p, np.float32) if min_p else None,
                seeds=np.zeros((R, 2), np.uint32), output_index=np.arange(R, dtype=np.int32),
                num_candidates=num_candidates([top_k] * R, [top_p] * R, args.vocab_size)
                if temperature else 0)
            mine = best_ms(lambda: sample_jit(logits, md, all_greedy=temperature == 0,
                                              num_logprobs=0).token_ids, args.repeats)
            keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(R))
            peer = best_ms((lambda: argmax_sample(logits)) if temperature == 0 else (
                lambda: full_sort_sample(logits, md.temperature, md.top_k, md.top_p,
                                         full(min_p, np.float32), keys)), args.repeats)
            results.append({"rows": R, "setting": name, "jaxpaged_ms": mine,
                            "full_sort_ms": peer, "full_sort/jaxpaged": peer / mine})
    report = {"config": portable_config(args), "vocab_size": args.vocab_size,
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'R':>4} {'setting':24} {'jaxpaged ms':>12} {'full sort ms':>13} {'ratio':>7}")
    for r in results:
        print(f"{r['rows']:>4} {r['setting']:24} {r['jaxpaged_ms']:>12.1f} "
              f"{r['full_sort_ms']:>13.1f} {r['full_sort/jaxpaged']:>6.1f}x")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
