"""The Mixture-of-Experts expert paths (`models.moe`) against each other, one layer's experts at
a time, by step size: which one the engine should take where.

    python bench/moe_paths.py                  # E=32 experts, top-4, D=1024, F=512
    python bench/moe_paths.py --experts 8 --top-k 2 --hidden 1024 --intermediate 1408

Random float32 tokens, weights and router logits; each path jitted alone; for each step size
the paths run in turns (`--rounds`, median of each), the dense and gathered paths only up to
`--dense-max-tokens` and `--gathered-max-tokens` (they grow with E x T and k x T matrices).
The C++ kernel ("kernel") is also timed on the same experts quantized to int8
("kernel-int8", beside the float paths, not among them). Writes bench/results/moe-paths.json:
per step size each path's time in ms and the fastest float path, beside the engine's pick (the
kernel where it runs, else `moe.choose_path`'s).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 256, 1024])
    p.add_argument("--dense-max-tokens", type=int, default=256)
    p.add_argument("--gathered-max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=RESULTS / "moe-paths.json")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpaged.models import moe
    from jaxpaged.models.layers import ACTIVATIONS
    from jaxpaged.models.quantization import quantize_experts_int8
    from jaxpaged.pallas_kernels import moe_experts

    E, k, D, F = args.experts, args.top_k, args.hidden, args.intermediate
    rng = np.random.default_rng(0)
    gate_up = jnp.asarray(rng.standard_normal((E, D, 2 * F)) * D ** -0.5, jnp.float32)
    down = jnp.asarray(rng.standard_normal((E, F, D)) * F ** -0.5, jnp.float32)
    act = ACTIVATIONS["silu"]
    # Each path's function and its experts, passed as arguments (constants would be folded).
    fns = {path: (jax.jit(lambda x, w, i, gu, dn, path=path: moe.experts_forward(
        x, w, i, gu, dn, act, path)), (gate_up, down)) for path in moe.PATHS}
    kernel = moe_experts.fits(jnp.zeros((1, D)), gate_up, down, "silu", tp=1)
    if kernel:
        (q_gu, s_gu), (q_d, s_d) = quantize_experts_int8(gate_up), quantize_experts_int8(down)
        fns["kernel-int8"] = (jax.jit(lambda x, w, i, gu, dn, sg, sd: moe.experts_forward(
            x, w, i, gu, dn, act, "kernel", scales=(sg, sd))), (q_gu, q_d, s_gu, s_d))
    rows = []
    for T in args.tokens:
        x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
        weights, ids = moe.route(jnp.asarray(rng.standard_normal((T, E)), jnp.float32),
                                 moe.Routing(k))
        paths = [p for p in fns if (p != "dense" or T <= args.dense_max_tokens)
                 and (p != "gathered" or T <= args.gathered_max_tokens)
                 and (kernel or not p.startswith("kernel"))]
        for path in paths:  # compile and warm
            jax.block_until_ready(fns[path][0](x, weights, ids, *fns[path][1]))
        times = {path: [] for path in paths}
        for r in range(args.rounds):
            for path in paths[r % len(paths):] + paths[:r % len(paths)]:
                start = time.perf_counter()
                jax.block_until_ready(fns[path][0](x, weights, ids, *fns[path][1]))
                times[path].append(time.perf_counter() - start)
        ms = {path: 1e3 * statistics.median(t) for path, t in times.items()}
        floats = {p: t for p, t in ms.items() if p != "kernel-int8"}
        row = {"tokens": T, "pairs": T * k, "ms": ms, "fastest": min(floats, key=floats.get),
               "engine_picks": "kernel" if kernel else moe.choose_path(T, k, E)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"config": {"experts": E, "top_k": k, "hidden": D, "intermediate": F,
                         "expert_bytes": 3 * D * F * 4, "rounds": args.rounds,
                         "gather_max_pairs": moe.GATHER_MAX_PAIRS,
                         "dense_max_rows": moe.DENSE_MAX_ROWS, "group_tile": moe.GROUP_TILE,
                         "cpu": platform.processor() or platform.machine(),
                         "devices": str(jax.devices())},
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
