"""Load time and step time across devices: safetensors against orbax, and tensor parallelism
(TP) 1 against 2, 4 and 8.

    python bench/parallel.py                 # 8 forced CPU devices (see below)
    python bench/parallel.py --tps 1 --devices 1 --out bench/results/parallel-gpu.json  # a GPU

The model is a Llama with random weights sized so that TP 8 divides it (16 query heads, 8 KV
heads, hidden 1024, FFN 2816, 8 layers, vocabulary 49152: 145M parameters, float32), saved with
transformers, then converted with `jaxpaged convert`. Each measurement runs in a fresh process
(jax reads the device count once), with `--xla_force_host_platform_device_count=--devices` on
CPU:

  load   `LLM(model, tensor_parallel_size=tp, precompile=False)` built --repeats times, from
         the safetensors folder and from the orbax one; the median seconds (engine build
         included: tokenizer, config, weights placed on their devices).
  step   32 requests of 64 random prompt tokens decoding together; after two warm-up decode
         steps, the median wall time of --steps decode steps (`LLMEngine.step`), in ms.

On CPU the forced devices share this machine's cores, so the TP figures show the cost of the
partitioning and its collectives, not a speed-up: for orientation only. Writes JSON to
bench/results/parallel.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent
CONFIG = dict(vocab_size=49152, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
              rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
              eos_token_id=2)


def make_model(root: Path) -> tuple[Path, Path]:
    """The random Llama as a safetensors folder and as its orbax conversion."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxpaged.entrypoints import cli
    from jaxpaged.model_loader.model_store import ensure_default_model

    hf, orbax = root / "hf", root / "orbax"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # SmolLM2's: the same vocabulary
        shutil.copy(ensure_default_model() / name, hf / name)
    assert cli.main(["convert", str(hf), str(orbax)]) == 0
    return hf, orbax


def child(task: dict) -> dict:
    """Runs one measurement (in a fresh process)."""
    import numpy as np

    from jaxpaged import LLM, SamplingParams

    kw = dict(tensor_parallel_size=task["tp"], precompile=False, max_model_len=256,
              num_kv_blocks=1024)
    if task["kind"] == "load":
        times = []
        for _ in range(task["repeats"]):
            start = time.perf_counter()
            LLM(task["model"], **kw)
            times.append(time.perf_counter() - start)
        return {"load_s": statistics.median(times), "load_s_all": times}
    llm = LLM(task["model"], max_num_seqs=32, **kw)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=task["steps"] + 8, ignore_eos=True)
    for i in range(32):
        engine.add_request({"prompt_token_ids": rng.integers(10, 40000, 64).tolist()}, params,
                           f"r{i}")
    while engine.stats()["num_generation_tokens"] < 32:  # the prefills
        engine.step()
    engine.step(), engine.step()  # compile and warm the decode step
    times = []
    for _ in range(task["steps"]):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return {"step_ms": 1e3 * statistics.median(times), "num_steps": len(times)}


def run_child(task: dict, devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    res = subprocess.run([sys.executable, __file__, "--child", json.dumps(task)], env=env,
                         capture_output=True, text=True, timeout=3600)
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if res.returncode or not lines:
        raise RuntimeError(f"{task} failed:\n{res.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--devices", type=int, default=8, help="forced CPU devices per process")
    p.add_argument("--repeats", type=int, default=3, help="loads per measurement")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed")
    p.add_argument("--out", type=Path, default=RESULTS / "parallel.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return

    with tempfile.TemporaryDirectory() as tmp:
        hf, orbax = make_model(Path(tmp))
        load, step = {}, {}
        for tp in sorted({1, max(args.tps)}):
            for fmt, model in (("safetensors", hf), ("orbax", orbax)):
                load[f"{fmt}/tp{tp}"] = run_child(
                    {"kind": "load", "model": str(model), "tp": tp, "repeats": args.repeats},
                    args.devices)
                print(f"load {fmt} tp={tp}: {load[f'{fmt}/tp{tp}']['load_s']:.2f} s", flush=True)
        for tp in args.tps:
            step[f"tp{tp}"] = run_child({"kind": "step", "model": str(hf), "tp": tp,
                                         "steps": args.steps}, args.devices)
            print(f"decode step tp={tp}: {step[f'tp{tp}']['step_ms']:.1f} ms", flush=True)

    import jax

    report = {
        "model": {**CONFIG, "num_parameters_m": 145, "dtype": "float32"},
        "devices": f"{args.devices} x {jax.default_backend()}"
                   + (" (forced host devices sharing the machine's cores)"
                      if jax.default_backend() == "cpu" else ""),
        "cpu_count": os.cpu_count(),
        "load": load,
        "orbax_over_safetensors_load": {
            f"tp{tp}": load[f"orbax/tp{tp}"]["load_s"] / load[f"safetensors/tp{tp}"]["load_s"]
            for tp in sorted({1, max(args.tps)})},
        "decode_step": step,
        "step_ms_over_tp1": {k: v["step_ms"] / step["tp1"]["step_ms"] for k, v in step.items()}
        if "tp1" in step else {},
        "command": "python " + " ".join([str(Path(sys.argv[0]).resolve().relative_to(REPO))]
                                        + sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out.resolve().relative_to(REPO)}")
    print(f"{'':24}{'seconds':>10}")
    for name, r in load.items():
        print(f"load {name:19}{r['load_s']:>10.2f}")
    for name, r in step.items():
        ratio = report["step_ms_over_tp1"].get(name)
        print(f"decode step {name:12}{r['step_ms'] / 1e3:>10.3f}"
              + (f"   x{ratio:.2f} of tp1" if ratio else ""))


if __name__ == "__main__":
    main()
