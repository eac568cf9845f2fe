"""The backends of `bench/throughput.py`: each replays the same requests
(`[{"prompt_token_ids": [...], "output_len": n}]`, EOS ignored) and returns its timings by name
suffix (`{"": {...}, "-greedy": {...}}`); `BACKENDS` maps the `--backend` names to them.

Backends:
  jaxpaged                  the whole request set through the engine (continuous batching,
                            prefix caching on); request i sampled with seed --seed + i.
  jaxpaged-no-prefix-cache  the same with `enable_prefix_caching=False`.
  jaxpaged-w8a8             the same with `quantization="w8a8"` (a Mixture-of-Experts model's
                            experts int8 weight-only, `models.quantization`).
  jaxpaged-1step            one decode step a call (`num_scheduler_steps=1`), synchronous.
  jaxpaged-async            the same with `async_scheduling=True`: the next step launched
                            before the last one's draws are read.
  jaxpaged-json             the structured-output workload: every request under a nested
                            JSON schema (`JSON_SCHEMA`), against the same requests without it
                            (`jaxpaged-json-none`), each of the same output length.
  hf                        transformers `generate`, static batches of --hf-batch-size (left
                            padding; a batch runs until its longest request ends).
  hf-cb                     transformers' continuous batching (`init_continuous_batching`,
                            per-request `add_request(max_new_tokens=...)`), its KV cache sized
                            to the workload.
"""

from __future__ import annotations

import argparse
import time

built_llms = []  # the engines this run built: the last one's settings go in the manifest


def build_llm(requests, args, enable_prefix_caching: bool = True):
    """(LLM, seconds to build it, compilation included)."""
    from jaxpaged import LLM

    max_len = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests)
    start = time.perf_counter()
    llm = LLM(args.model, max_model_len=max(max_len, args.max_model_len),
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=enable_prefix_caching,
              precompile=args.warmup == "precompile", batch_invariant=args.batch_invariant,
              attention_backend=args.attention_backend,
              quantization=None if args.quantization == "none" else args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, dtype=getattr(args, "dtype", "auto"),
              num_scheduler_steps=getattr(args, "num_scheduler_steps", None),
              async_scheduling=getattr(args, "async_scheduling", False))
    built_llms.append(llm)
    return llm, time.perf_counter() - start


def run_jaxpaged(requests, args, enable_prefix_caching: bool = True) -> dict:
    from jaxpaged import SamplingParams

    llm, startup = build_llm(requests, args, enable_prefix_caching)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    results = {}
    for suffix, sampling in [("", sampling_settings(args))] + (
            [("-greedy", {"temperature": 0.0})] if args.temperature > 0 else []):
        params = [SamplingParams(max_tokens=r["output_len"], ignore_eos=True, seed=args.seed + i,
                                 **sampling) for i, r in enumerate(requests)]
        cold = None
        if args.warmup == "workload":  # compile what the workload touches
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            cold = time.perf_counter() - start
        llm.reset_prefix_cache()  # each pass starts with an empty prefix cache
        compiles = llm.stats()["num_compilations"]
        result = run_jaxpaged_timed(llm, prompts, params, requests)
        result.update(attention_backend=llm.llm_engine.attention_backend, startup_s=startup,
                      cold_elapsed_s=cold, num_compilations_warmup=compiles,
                      num_compilations_timed=llm.stats()["num_compilations"] - compiles,
                      sampling=sampling)
        results[suffix] = result
    return results


def sampling_settings(args) -> dict:
    """The sampling fields every backend gets: temperature, top_p, top_k (0: off)."""
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}


def hf_sampling(args) -> dict:
    """`generate` keyword arguments for the same sampling (HF's own top_k default is 50; 0 is
    off)."""
    if args.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, **sampling_settings(args)}


def run_jaxpaged_timed(llm, prompts, params, requests) -> dict:
    """Steps the engine by hand to watch KV usage after every step."""
    engine = llm.llm_engine
    S, max_model_len = engine.cache_config.block_size, engine.scheduler_config.max_model_len
    start = time.perf_counter()
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    finished, peak = [], {"blocks": 0}
    num_steps = 0
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
        num_steps += 1
        running = engine.scheduler.running
        used = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
        if used > peak["blocks"]:
            peak = {"blocks": used, "seqs": len(running),
                    "slots_filled": _filled_slots(running, S),
                    "tokens": sum(s.num_tokens for s in running)}
    elapsed = time.perf_counter() - start
    assert sorted(len(o.outputs[0].token_ids) for o in finished) == sorted(
        r["output_len"] for r in requests)
    allocated = peak["blocks"] * S
    contiguous = peak["seqs"] * max_model_len  # each running request reserves max_model_len
    return {"elapsed_s": elapsed, "num_steps": num_steps,
            "num_cached_tokens": sum(o.num_cached_tokens for o in finished),
            "kv_waste_at_peak": 1 - peak["slots_filled"] / allocated if allocated else 0.0,
            "contiguous_kv_waste_at_peak": 1 - peak["tokens"] / contiguous if contiguous else 0.0,
            "peak_kv_blocks": peak["blocks"], "peak_running_seqs": peak["seqs"]}


def _filled_slots(seqs, block_size: int) -> int:
    """Token slots holding K/V in the blocks these sequences hold, each shared block once."""
    filled: dict[int, int] = {}
    for seq in seqs:
        for i, block_id in enumerate(seq.block_table):
            n = min(block_size, max(0, seq.num_tokens - i * block_size))
            filled[block_id] = max(filled.get(block_id, 0), n)
    return sum(filled.values())


def run_hf(requests, args) -> dict:
    import torch

    model = _hf_model(args)
    pad = model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id
    start = time.perf_counter()
    for i in range(0, len(requests), args.hf_batch_size):
        batch = requests[i:i + args.hf_batch_size]
        width = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):  # left padding
            n = len(r["prompt_token_ids"])
            ids[row, width - n:] = torch.tensor(r["prompt_token_ids"])
            mask[row, width - n:] = 1
        new = max(r["output_len"] for r in batch)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, pad_token_id=pad, **hf_sampling(args))
    return {"elapsed_s": time.perf_counter() - start, "sampling": sampling_settings(args)}


def run_hf_cb_and_greedy(requests, args) -> dict:
    """`run_hf_cb` with the sampling settings, and greedy beside it (as jaxpaged runs), on one
    loaded model. Neither has an untimed pass: the sampled one, first, pays transformers'
    first-run costs, so hf-cb's greedy/sampled ratio leans towards greedy."""
    model = _hf_model(args)
    results = {"": run_hf_cb(requests, args, model)}
    if args.temperature > 0:
        results["-greedy"] = run_hf_cb(requests, argparse.Namespace(
            **{**vars(args), "temperature": 0.0}), model)
    return results


def run_hf_cb(requests, args, model=None) -> dict:
    """transformers' continuous batching, as its docs show it: a manager, one request each."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = model or _hf_model(args)
    block = 256  # its default page size
    num_blocks = sum(-(-(len(r["prompt_token_ids"]) + r["output_len"]) // block)
                     for r in requests[:args.max_num_seqs]) + 8
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(**hf_sampling(args)),
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=num_blocks, max_requests_per_batch=args.max_num_seqs))
    manager.start()
    start = time.perf_counter()
    try:
        for i, r in enumerate(requests):  # eos_token_id=-1: no EOS, as ignore_eos
            manager.add_request(r["prompt_token_ids"], request_id=f"r{i}",
                                max_new_tokens=r["output_len"], eos_token_id=-1)
        done = {}
        while len(done) < len(requests):
            result = manager.get_result(timeout=5)
            if result is not None and result.is_finished():
                done[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    lengths = sorted(len(d.generated_tokens) for d in done.values())
    assert lengths == sorted(r["output_len"] for r in requests), "hf-cb output lengths differ"
    return {"elapsed_s": elapsed, "sampling": ({"temperature": 0.0} if args.temperature == 0
                                               else sampling_settings(args))}


def _hf_model(args):
    """The transformers model of `args.model` in `args.dtype` ("auto": float32) on
    `args.device` (default "cpu")."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpaged.model_loader.model_store import resolve_model

    dtype = getattr(args, "dtype", "auto")
    return AutoModelForCausalLM.from_pretrained(
        resolve_model(args.model),
        dtype=torch.float32 if dtype == "auto" else getattr(torch, dtype),
    ).to(getattr(args, "device", "cpu")).eval()


# The structured-output workload's schema: nested, with an enum, arrays and required fields;
# its free-text fields leave the length to the model.
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "answer": {"type": "object", "properties": {
            "summary": {"type": "string"}, "confidence": {"type": "number"},
            "steps": {"type": "array", "items": {"type": "string"}}},
            "required": ["summary", "confidence", "steps"]},
    },
    "required": ["title", "sentiment", "keywords", "answer"],
}


def run_jaxpaged_json(requests, args) -> dict:
    """The structured-output workload: every request under `JSON_SCHEMA` (up to its reference
    output length; the grammar ends most earlier), against the same requests unconstrained,
    each generating (EOS ignored) exactly the tokens its constrained run did. The constrained
    pass runs once untimed first: it sets the lengths and compiles the masked sampler."""
    from jaxpaged import SamplingParams, StructuredOutputsParams

    llm, startup = build_llm(requests, args)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    schema = StructuredOutputsParams(json=JSON_SCHEMA)
    constrained = [SamplingParams(max_tokens=r["output_len"], seed=args.seed + i,
                                  structured_outputs=schema, **sampling_settings(args))
                   for i, r in enumerate(requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, constrained, use_tqdm=False)
    cold = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    finished = [{**r, "output_len": n} for r, n in zip(requests, lengths)]
    free = [SamplingParams(max_tokens=n, ignore_eos=True, seed=args.seed + i,
                           **sampling_settings(args)) for i, n in enumerate(lengths)]
    results = {}
    for suffix, params in [("-none", free), ("", constrained)]:
        llm.reset_prefix_cache()
        compiles = llm.stats()["num_compilations"]
        result = run_jaxpaged_timed(llm, prompts, params, finished)
        result.update(output_lens=lengths, sampling=sampling_settings(args), startup_s=startup,
                      cold_elapsed_s=cold, num_compilations_warmup=compiles,
                      num_compilations_timed=llm.stats()["num_compilations"] - compiles,
                      num_finished_by_grammar=sum(o.outputs[0].finish_reason == "stop"
                                                  for o in outputs),
                      json_schema=JSON_SCHEMA if suffix == "" else None)
        results[suffix] = result
    return results


BACKENDS = {"jaxpaged": run_jaxpaged,
            "jaxpaged-json": run_jaxpaged_json,
            "jaxpaged-no-prefix-cache": lambda reqs, args: run_jaxpaged(reqs, args, False),
            "jaxpaged-w8a8": lambda reqs, args: run_jaxpaged(reqs, argparse.Namespace(
                **{**vars(args), "quantization": "w8a8"})),
            "jaxpaged-1step": lambda reqs, args: run_jaxpaged(reqs, argparse.Namespace(
                **{**vars(args), "num_scheduler_steps": 1})),
            "jaxpaged-async": lambda reqs, args: run_jaxpaged(reqs, argparse.Namespace(
                **{**vars(args), "num_scheduler_steps": 1, "async_scheduling": True})),
            "hf": lambda reqs, args: {"": run_hf(reqs, args)},
            "hf-cb": run_hf_cb_and_greedy}
