"""Paged-attention kernel timings: jaxpaged's Pallas kernels against the jnp reference and jax's
bundled `jax.experimental.pallas.ops.gpu.paged_attention`, in the same run.

On a GPU: bfloat16, batch 1-256, context 128-8192, Llama-3-8B-like heads (32 query heads on 8 KV
heads, head_dim 128, block_size 16). Reports microseconds per call and achieved bandwidth (K/V
bytes read / time) as a fraction of the device's copy bandwidth measured in the same run; JSON to
bench/results/kernels.json and a table printed last.

On CPU (no GPU): a dry run on tiny shapes with the kernels interpreted, checking that every
kernel agrees with the reference and that the script and its JSON work; timings there are
meaningless and are labelled so.

    python bench/kernel_table.py            # GPU: full table; CPU: dry run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax.experimental.pallas.ops.gpu.paged_attention import (
    paged_attention as jax_paged_attention)

from jaxpaged.pallas_kernels import (paged_attention, paged_attention_reference,
                                     ragged_paged_attention)

RESULTS = Path(__file__).resolve().parent / "results"


def timeit(fn, *args, reps: int) -> float:
    """Median seconds per call, after one untimed call (compilation)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_bandwidth(num_bytes: int, reps: int) -> float:
    """Device copy bandwidth in bytes/s (bytes read + bytes written)."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    t = timeit(jax.jit(lambda a: a * 1.0), x, reps=reps)
    return 2 * x.nbytes / t


def make_case(rng, B, ctx, N, K, H, S, dtype):
    M = -(-ctx // S)
    P = B * M
    q = jnp.asarray(rng.standard_normal((B, N, H)), dtype)
    k_pages = jnp.asarray(rng.standard_normal((K, P, S, H)), dtype)
    v_pages = jnp.asarray(rng.standard_normal((K, P, S, H)), dtype)
    block_tables = jnp.asarray(rng.permutation(P).reshape(B, M), jnp.int32)
    context_lens = jnp.full((B,), ctx, jnp.int32)
    return q, k_pages, v_pages, block_tables, context_lens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="default: bench/results/kernels.json (GPU), kernels-dryrun.json (CPU)")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    if on_gpu:
        N, K, H, S, dtype = 32, 8, 128, 16, jnp.bfloat16
        batches, contexts, interpret = [1, 8, 64, 256], [128, 512, 2048, 8192], False
        bandwidth = copy_bandwidth(1 << 30, args.reps)
    else:
        N, K, H, S, dtype = 4, 2, 64, 16, jnp.float32
        batches, contexts, interpret = [1, 4], [32, 80], True
        args.reps, bandwidth = 1, float("nan")
    scale = H ** -0.5
    rng = np.random.default_rng(0)
    rows = []
    for B in batches:
        for ctx in contexts:
            q, kp, vp, bt, cl = make_case(rng, B, ctx, N, K, H, S, dtype)
            kv_bytes = 2 * B * ctx * K * H * jnp.dtype(dtype).itemsize
            ref_out = paged_attention_reference(q, kp, vp, bt, cl, scale=scale)
            fns = {"reference": jax.jit(lambda *a: paged_attention_reference(*a, scale=scale))}
            for k_splits in (1, 8):
                if bt.shape[1] >= k_splits:
                    fns[f"decode/k{k_splits}"] = lambda *a, ks=k_splits: paged_attention(
                        *a, scale=scale, k_splits=ks, interpret=interpret)
            cu = jnp.arange(B + 1, dtype=jnp.int32)
            fns["ragged"] = lambda q, kp, vp, bt, cl: ragged_paged_attention(
                q, kp, vp, bt, cl, cu, B, scale=scale, interpret=interpret)
            M = bt.shape[1]
            splits = max(s for s in (1, 2, 4, 8, 16) if M % s == 0)
            fns["jax-bundled"] = lambda q, *a, ks=splits, M=M: jax_paged_attention(
                q * scale, *a, k_splits=ks, pages_per_compute_block=min(8, M // ks),
                interpret=interpret)
            row = {"batch": B, "context": ctx}
            for name, fn in fns.items():
                out = fn(q, kp, vp, bt, cl)
                err = float(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32)).max())
                t = timeit(fn, q, kp, vp, bt, cl, reps=args.reps)
                row[name] = {"us": t * 1e6, "max_abs_err": err,
                             "bandwidth_fraction": kv_bytes / t / bandwidth}
            rows.append(row)
            print(f"B={B:<4} ctx={ctx:<5} " + "  ".join(
                f"{n}={r['us']:.0f}us" for n, r in row.items() if isinstance(r, dict)), flush=True)

    args.out = args.out or RESULTS / ("kernels.json" if on_gpu else "kernels-dryrun.json")
    report = {"device": str(jax.devices()[0]), "dry_run": not on_gpu, "dtype": str(dtype),
              "heads": {"q": N, "kv": K, "head_dim": H, "block_size": S},
              "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    names = [n for n in rows[0] if isinstance(rows[0][n], dict)]
    print(f"\n{'batch':>5} {'ctx':>6} " + " ".join(f"{n:>22}" for n in names))
    for row in rows:
        print(f"{row['batch']:>5} {row['context']:>6} " + " ".join(
            f"{row[n]['us']:>9.1f}us {row[n]['bandwidth_fraction']:>6.1%} bw" if n in row
            else f"{'-':>22}" for n in names))
    if not on_gpu:
        print("\nCPU dry run: kernels interpreted; timings are not GPU figures.")
    bad = [(r["batch"], r["context"], n) for r in rows for n in names
           if n in r and r[n]["max_abs_err"] > (1e-4 if dtype == jnp.float32 else 5e-2)]
    if bad:
        raise SystemExit(f"kernel disagrees with the reference: {bad}")


if __name__ == "__main__":
    main()
