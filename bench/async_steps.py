"""A decode step with and without async scheduling, on this machine: where the host's share of a
step is what async scheduling can take off the critical path.

    python bench/async_steps.py [--model DIR] [--batches 1 8 64] [--rounds 3]

For each batch size: the default model (or `--model`) decoding `batch` random 64-token prompts
greedily, one step a call; the median engine step, synchronous (with the device step and the
sampler each waited for and timed, `gpu_e2e.step_split`) and with `async_scheduling`, in
alternating rounds. Writes bench/results/async-steps.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import step_split  # noqa: E402
from report import portable_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local HF folder; default: embedded SmolLM2")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed a round")
    p.add_argument("--out", type=Path, default=RESULTS / "async-steps.json")
    args = p.parse_args(argv)
    report = {"config": {**portable_config(args),
                         "host": platform.processor() or platform.machine()}, "batches": {}}
    for batch in args.batches:
        rounds = [step_split(args.model, argparse.Namespace(dtype="auto", batch=batch),
                             steps=args.steps) for _ in range(args.rounds)]
        med = {key: float(np.median([r[key] for r in rounds]))
               for key in ("engine_step_ms", "device_step_ms", "sampler_ms", "host_ms",
                           "idle_share", "async_engine_step_ms", "async_idle_share")}
        med["async_speedup"] = med["engine_step_ms"] / med["async_engine_step_ms"]
        report["batches"][str(batch)] = {"median": med, "rounds": rounds}
        print(f"batch {batch}: sync {med['engine_step_ms']:.2f} ms (device "
              f"{med['device_step_ms']:.2f}, sampler {med['sampler_ms']:.2f}, host "
              f"{med['host_ms']:.2f}, idle {100 * med['idle_share']:.0f}%); async "
              f"{med['async_engine_step_ms']:.2f} ms ({med['async_speedup']:.2f}x)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
