"""Cold and warm start: `LLM()` from import to ready, and a one-shot `jaxpaged generate`.

    python bench/startup.py                     # the default model
    python bench/startup.py --model google/gemma-3-270m --repeats 1

Each run is a fresh process. Cold: an empty compilation cache (a new folder given through
JAXPAGED_COMPILATION_CACHE_DIR); warm: the same folder again, filled by the cold run. The
model is imported into $JAXPAGED_HOME beforehand, so neither measures the first import of an
embedded model. `LLM()` is timed inside its process from before `import jaxpaged` until the
constructor returns (default settings: precompile on); `generate` is the whole command, wall
clock, 8 greedy tokens. Reports seconds, the processes' peak RSS and whether torch is installed
(a start imports it only for a tokenizer that needs AutoTokenizer: about 1.5 s) to
bench/results/startup.json. Run it with another environment's python
(`/path/to/venv/bin/python bench/startup.py`) to time that one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import portable_config  # noqa: E402

LLM_SCRIPT = """
import sys, time
start = time.perf_counter()
from jaxpaged import LLM
llm = LLM(None if sys.argv[1] == "default" else sys.argv[1])
print(time.perf_counter() - start)
"""


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{proc.stderr[-3000:]}")
    return elapsed, proc.stdout


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--repeats", type=int, default=2, help="warm runs of each (best reported)")
    p.add_argument("--out", type=Path, default=Path("bench/results/startup.json"))
    args = p.parse_args(argv)
    from jaxpaged.model_loader.model_store import resolve_model
    resolve_model(None if args.model == "default" else args.model)
    jaxpaged_cmd = str(Path(sys.executable).parent / "jaxpaged")
    gen = [jaxpaged_cmd, "generate", "The capital of France is", "--max-tokens", "8",
           "--temperature", "0"] + ([] if args.model == "default" else ["--model", args.model])
    results = {}
    for name, cmd, from_output in (
            ("LLM()", [sys.executable, "-c", LLM_SCRIPT, args.model], True),
            ("jaxpaged generate", gen, False)):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, JAXPAGED_COMPILATION_CACHE_DIR=cache)
            env.setdefault("JAX_PLATFORMS", "cpu")
            runs = []
            for _ in range(1 + args.repeats):
                wall, out = timed(cmd, env)
                runs.append(float(out.strip().splitlines()[-1]) if from_output else wall)
            results[name] = {"cold_s": runs[0], "warm_s": min(runs[1:]), "warm_runs_s": runs[1:],
                             "process_wall_s_last": wall}
            print(name, results[name], flush=True)
    import importlib.util
    environment = {  # what the imports cost depends on
        "torch_installed": importlib.util.find_spec("torch") is not None,
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE")}
    report = {"config": portable_config(args), "environment": environment, "results": results,
              "peak_rss_children_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
