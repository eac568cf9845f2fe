"""tunix's GRPO loop with jaxpaged as its rollout engine against tunix's own "vanilla" rollout:
seconds per training step of `GRPOLearner.train` (2 prompts x 2 generations x 16 tokens per
step, tunix's Llama 3 actor and reference, AdamW), full weights and a qwix LoRA actor, in one
run. The loop is `tests/test_tunix.py`'s `run_grpo`, unchanged apart from the engine.

Runs in tunix's virtualenv (`make test-tunix` builds it):

    .venv-tunix/bin/python bench/tunix_grpo.py                   # the tests' tiny Llama
    .venv-tunix/bin/python bench/tunix_grpo.py --model default   # SmolLM2-135M's weights

The first step of each run compiles (both engines) and is reported apart; the figure is the
median of the later steps. With the vanilla rollout on the actor's mesh tunix shares the
actor's arrays (no sync); jaxpaged gets every step's weights by `sync_weights`. JSON goes to
bench/results/tunix_grpo.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "default"], default="tiny")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "tunix_grpo.json")
    args = p.parse_args(argv)

    import numpy as np
    sys.path.insert(0, str(ROOT / "tests"))
    import test_tunix as t  # noqa: E402  (the loop, the tiny model, the tunix model builder)
    from jaxpaged.integrations.tunix import JaxpagedRollout
    from jaxpaged.model_loader.model_store import ensure_default_model

    default_model = ensure_default_model()
    if args.model == "tiny":
        model_dir = Path(tempfile.mkdtemp()) / "tiny"
        t.save_family("llama3", model_dir, 0, default_model, tie_word_embeddings=True)
    else:
        model_dir = default_model

    results: dict = {"config": {k: str(v.relative_to(ROOT)) if isinstance(v, Path) else v
                                for k, v in vars(args).items()}, "runs": []}
    for _ in range(args.rounds):
        for lora in (False, True):
            for name in ("vanilla", "jaxpaged"):
                engine = name if name == "vanilla" else functools.partial(
                    JaxpagedRollout, model=str(model_dir), pad_id=0,
                    lora_alpha=8.0 if lora else None, precompile=False)
                start, ends = time.perf_counter(), []
                t.run_grpo(model_dir, engine, lora, steps=args.steps, step_ends=ends)
                steps = np.diff([start] + ends)
                run = {"engine": name, "lora": lora, "first_step_s": float(steps[0]),
                       "later_steps_s": [float(x) for x in steps[1:]],
                       "s_per_step": float(np.median(steps[1:]))}
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
    for lora in (False, True):
        by = {name: np.median([r["s_per_step"] for r in results["runs"]
                               if r["engine"] == name and r["lora"] == lora])
              for name in ("vanilla", "jaxpaged")}
        results["full" if not lora else "lora"] = {
            "vanilla_s_per_step": float(by["vanilla"]),
            "jaxpaged_s_per_step": float(by["jaxpaged"]),
            "jaxpaged_over_vanilla_time": float(by["jaxpaged"] / by["vanilla"])}
    results["machine"] = f"{os.cpu_count()} CPU cores, CPU only"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("full", "lora")}, indent=2))
    return results


if __name__ == "__main__":
    main()
