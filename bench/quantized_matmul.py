"""Each 8-bit matmul path against float32 on a model's layer shapes, by rows per step.

    python bench/quantized_matmul.py --out bench/results/quantized-matmul.json

For each weight shape of the default model (SmolLM2-135M: q_proj, gate_proj, down_proj and the
tied LM head) and each number of rows M (tokens in the step), the median time of one jitted call
of:
- `float32`: `x @ w.T` in float32 (XLA's dot);
- `int8`: weight-only int8, per output channel (`int8_matmul`, the C++ kernel);
- `int8-dot-xla` / `int8-dot-kernel`: the bare int8 x int8 -> int32 product of M int8 rows
  (x cast to int8) by XLA's int8 dot / by the C++ VNNI GEMM on packed weights (`pack_int8`);
- `w8a8-xla` / `w8a8-kernel`: W8A8 per channel, the whole call (two int8 terms per row, so
  twice M rows, and their quantization) with each of those products, the kernel being the
  engine's path on CPU;
- `q8_0-kernel`: GGUF Q8_0 blocks as they are, x quantized per 32 values and multiplied block
  by block by the C++ kernel (`q8_0_dot_kernel`, any number of rows);
- `q8_0-float`: x in float32 times the Q8_0 blocks' values (XLA's dot);
- `q8_0-xla`: the Q8_0 block product as XLA's int8 dot batched over blocks (up to 32 rows:
  it is far slower).
The engine's choices (the packed W8A8 GEMM at every size, `Q8_0_KERNEL_MAX_ROWS`, the GGUF
default) follow these numbers. Ratios are against float32 in the same run (> 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import call_times  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# (name, N, K) of SmolLM2-135M's matmuls
SHAPES = (("q_proj", 576, 576), ("gate_proj", 1536, 576), ("down_proj", 576, 1536),
          ("lm_head", 49152, 576))
XLA_BLOCKS_MAX_ROWS = 32


def paths(rows: int):
    """{name: fn(x, weights)} for the paths that run at `rows` rows."""

    import jax

    from jaxpaged.pallas_kernels import quantized_matmul as qm

    def w8a8_kernel(x, wt):
        return qm.w8a8_matmul(x, wt["wp"], wt["scale"], wt["wsum"])

    def q8_0_kernel(x, wt):
        xq, dx = qm.quantize_q8_0(x)
        return qm.q8_0_dot_kernel(xq, dx, wt["q8"], wt["d8"])

    import jax.numpy as jnp

    def dot_kernel(x, wt):
        return qm.int8_dot_kernel(x.astype(jnp.int8), wt["wp"], wt["wsum"], wt["w"].shape[0])

    fns = {"float32": lambda x, wt: x @ wt["f"].T,
           "int8-dot-xla": lambda x, wt: qm.int8_dot_reference(x.astype(jnp.int8), wt["w"]),
           "int8-dot-kernel": dot_kernel,
           "int8": lambda x, wt: qm.int8_matmul(x, wt["w"], wt["scale"], use_kernel=True),
           "w8a8-xla": lambda x, wt: qm.w8a8_matmul(x, wt["w"], wt["scale"]),
           "w8a8-kernel": w8a8_kernel,
           "q8_0-kernel": q8_0_kernel,
           "q8_0-float": lambda x, wt: qm.q8_0_matmul(x, wt["q8"], wt["d8"], use_kernel=False,
                                                      activations="auto")}
    if rows <= XLA_BLOCKS_MAX_ROWS:
        fns["q8_0-xla"] = lambda x, wt: qm.q8_0_matmul(x, wt["q8"], wt["d8"], use_kernel=False,
                                                       activations="q8_0")
    return {name: jax.jit(fn) for name, fn in fns.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32, 128, 512])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=RESULTS / "quantized-matmul.json")
    args = p.parse_args(argv)


    import jax
    import jax.numpy as jnp

    from jaxpaged.pallas_kernels import cpu_attention
    from jaxpaged.pallas_kernels import quantized_matmul as qm
    from jaxpaged.platforms import current_platform

    current_platform()  # configures and builds the C++ kernels
    if not cpu_attention.available():
        raise SystemExit("the C++ kernels are not available here")
    rng = np.random.default_rng(0)
    rows_out = []
    for name, N, K in SHAPES:
        f = jnp.asarray(rng.standard_normal((N, K)), jnp.float32) * 0.05
        w, scale = qm.quantize_int8(f)
        q8, d8 = qm.quantize_q8_0(f)
        wp, wsum = qm.pack_int8(w)
        wt = {"f": f, "w": w, "scale": scale, "wp": wp, "wsum": wsum, "q8": q8, "d8": d8}
        for M in args.rows:
            x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
            ms = {path: 1e3 * statistics.median(call_times(
                      lambda: jax.block_until_ready(fn(x, wt)), args.repeats))
                  for path, fn in paths(M).items()}
            row = {"shape": name, "N": N, "K": K, "rows": M, "ms": ms,
                   "speedup_vs_float32": {k: ms["float32"] / v for k, v in ms.items()}}
            rows_out.append(row)
            print(name, M, " ".join(f"{k}={v:.3f}" for k, v in ms.items()), flush=True)
    report = {"config": {"shapes": [list(s) for s in SHAPES], "rows": args.rows,
                         "repeats": args.repeats, "unit": "ms per call (median)",
                         "cpu": platform.processor() or platform.machine(),
                         "w8a8_kernel_isa": cpu_attention.w8a8_isa()},
              "results": rows_out}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
