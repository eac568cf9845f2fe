"""The research API's costs on one model: an `update_params` (and `load_weights`), and
`completion_logprobs` against `generate`'s prefill of the same tokens.

    python bench/research_api.py                  # the default model, 64 x 256 tokens

Weights: the engine's parameters given back as they are (jax arrays on the engine's device:
nothing to copy), as NumPy arrays (a copy to the device), and as Hugging Face tensors through
`load_weights` (transposed and stacked on the host first); the median of `--repeats` runs.

Scoring: `--num-completions` completions of `--completion-len` random tokens after one prompt,
scored by `completion_logprobs` (the prompt's blocks computed once and shared by prefix
caching), against `generate` with `max_tokens=1` over the same prompt + completion pairs: the
same tokens computed through the same steps, without logits at every position. Each side runs
once untimed (compiling the shapes it meets), then timed; reports tokens per second of the
completion tokens and the ratio, to bench/results/research_api.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import portable_config  # noqa: E402

from jaxpaged import LLM, SamplingParams  # noqa: E402


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-completions", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench/results/research_api.json"))
    args = p.parse_args(argv)

    llm = LLM(args.model, max_model_len=1024)
    engine = llm.llm_engine
    params = llm.get_params()
    on_host = jax.tree.map(np.asarray, params)

    def update(tree):
        llm.update_params(tree)
        jax.block_until_ready(jax.tree.leaves(llm.get_params()))

    tensors = load_file(next(Path(engine.model_dir).glob("*.safetensors")))
    weights = {
        "update_params_on_device_s": median_time(lambda: update(params), args.repeats),
        "update_params_from_numpy_s": median_time(lambda: update(on_host), args.repeats),
        "load_weights_hf_names_s": median_time(
            lambda: (llm.load_weights(tensors.items()),
                     jax.block_until_ready(jax.tree.leaves(llm.get_params()))), args.repeats),
        "weight_bytes": int(sum(x.nbytes for x in jax.tree.leaves(params))),
    }

    rng = np.random.default_rng(0)
    V = engine.model_config.vocab_size
    prompt = rng.integers(0, V, args.prompt_len).tolist()
    completions = [rng.integers(0, V, args.completion_len).tolist()
                   for _ in range(args.num_completions)]
    pairs = [{"prompt_token_ids": prompt + c} for c in completions]
    one_token = SamplingParams(temperature=0, max_tokens=1)

    def score():
        llm.reset_prefix_cache()
        return llm.completion_logprobs(prompt, completions)

    def prefill():
        llm.reset_prefix_cache()
        return llm.generate(pairs, one_token, use_tqdm=False)

    results = {}
    for name, fn in (("completion_logprobs", score), ("generate_prefill", prefill)):
        fn()  # compiles the shapes it meets
        seconds = median_time(fn, 1)
        results[name] = {"seconds": seconds, "completion_tokens_per_s":
                         args.num_completions * args.completion_len / seconds}
    ratio = (results["completion_logprobs"]["completion_tokens_per_s"]
             / results["generate_prefill"]["completion_tokens_per_s"])
    report = {"config": portable_config(args), "weights": weights, "scoring": results,
              "ratio_scoring_to_prefill": ratio,
              "device": jax.devices()[0].device_kind, "platform": jax.default_backend()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
