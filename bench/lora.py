"""Multi-LoRA serving cost: the 64-prompt ShareGPT set with 4 rank-16 adapters spread over the
requests (request i under adapter i mod 4, on every projection) against the same requests on
the base model without LoRA, in the same run; and `LLM.update_lora`'s time for one adapter.

    python bench/lora.py                       # SmolLM2-135M, 64 prompts, 2 rounds
    python bench/lora.py --num-prompts 16 --rounds 1

The adapters are random (peft's `init_lora_weights=False`), saved as PEFT folders in a
temporary directory. Each engine first runs the workload once (compiling what it touches); the
timed rounds then alternate base and LoRA. JSON goes to bench/results/lora.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from report import portable_config  # noqa: E402
from sharegpt import sample_requests  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, folder: Path, count: int, rank: int) -> list[Path]:
    """`count` random PEFT LoRA folders of rank `rank` on every projection of the model."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                target_modules=TARGETS,
                                                init_lora_weights=False))
        paths.append(folder / f"adapter{i}")
        model.save_pretrained(paths[-1])
        base = model.unload()
    return paths


def timed(llm, prompts, params, loras) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(outs, params))
    return elapsed


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--out", type=Path, default=RESULTS / "lora.json")
    args = p.parse_args(argv)

    from jaxpaged import LLM, LoRARequest, SamplingParams
    from jaxpaged.model_loader.model_store import ensure_default_model
    from safetensors.numpy import load_file

    model_dir = ensure_default_model()
    llm_base = LLM(max_model_len=2048, max_num_seqs=args.max_num_seqs)
    tokenizer = llm_base.get_tokenizer()
    requests = sample_requests(tokenizer, args.num_prompts, seed=0)
    prompts = [{"prompt_token_ids": tokenizer(prompt).input_ids} for prompt, _, _ in requests]
    params = [SamplingParams(max_tokens=min(n, args.max_output), ignore_eos=True, seed=i)
              for i, (_, _, n) in enumerate(requests)]
    output_tokens = sum(sp.max_tokens for sp in params)
    with tempfile.TemporaryDirectory() as tmp:
        folders = make_adapters(model_dir, Path(tmp), args.num_adapters, args.rank)
        llm_lora = LLM(max_model_len=2048, max_num_seqs=args.max_num_seqs, enable_lora=True,
                       max_loras=args.num_adapters, max_lora_rank=args.rank)
        loras = [LoRARequest(f"adapter{i % len(folders)}", i % len(folders) + 1,
                             str(folders[i % len(folders)])) for i in range(len(prompts))]
        for llm, lora in ((llm_base, None), (llm_lora, loras)):  # compile what the run touches
            timed(llm, prompts, params, lora)
        base_s, lora_s = [], []
        for _ in range(args.rounds):
            for llm, lora, times in ((llm_base, None, base_s), (llm_lora, loras, lora_s)):
                llm.reset_prefix_cache()
                times.append(timed(llm, prompts, params, lora))
        tensors = load_file(folders[0] / "adapter_model.safetensors")
        update_s = []
        for i in range(5):
            start = time.perf_counter()
            llm_lora.update_lora("adapter0", {k: v * (1 + i) for k, v in tensors.items()})
            update_s.append(time.perf_counter() - start)
        compiles = llm_lora.stats()["num_compilations"]
    base_tps = output_tokens / float(np.median(base_s))
    lora_tps = output_tokens / float(np.median(lora_s))
    result = {
        "config": portable_config(args),
        "output_tokens": output_tokens,
        "base_elapsed_s": base_s, "lora_elapsed_s": lora_s,
        "base_output_tok_per_s": base_tps, "lora_output_tok_per_s": lora_tps,
        "lora_over_base": lora_tps / base_tps,
        "update_lora_s": update_s, "update_lora_median_s": float(np.median(update_s)),
        "lora_engine_compilations": compiles,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=2))
    return result


if __name__ == "__main__":
    main()
