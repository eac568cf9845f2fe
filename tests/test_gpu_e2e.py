"""`bench/gpu_e2e.py --smoke` end to end on CPU: a tiny random Llama through jaxpaged (with and
without async scheduling) and transformers' continuous batching, the decode step's split, the
decode kernel (interpreted) against a device copy, and cold and warm engine builds, written as
the JSON the GPU run writes (the GPU figures themselves come from a lent machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_the_gpu_script_runs_end_to_end_on_cpu_with_a_tiny_model(tmp_path):
    out = tmp_path / "gpu-e2e-smoke.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_e2e.py"), "--smoke", "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    run = report["throughput"]["tiny-llama"]
    assert run["num_output_tokens"] == 4 * 8
    for backend in ("jaxpaged", "jaxpaged-async", "hf-cb"):
        assert run[backend]["output_tokens_per_s"] > 0
    assert run["ratio"] > 0 and run["ratio_async"] > 0
    split = report["step_split"]
    assert split["batch"] == 4 and split["device_step_ms"] > 0
    assert abs(split["engine_step_ms"] - split["device_step_ms"] - split["sampler_ms"]
               - split["host_ms"]) < 1e-6
    assert split["async_engine_step_ms"] > 0 and 0 <= split["async_idle_share"] < 1
    assert split["kv_pool_blocks"] > 0
    kernel = report["decode_kernel"]
    assert {"copy", "float32", "int8", "fp8"} <= set(kernel)
    assert kernel["int8"]["pool_bytes"] < kernel["float32"]["pool_bytes"]
    for kind in ("float32", "int8", "fp8"):
        assert len(kernel[kind]["sweep"]) == 2 and kernel[kind]["best"]["GB_per_s"] > 0
    assert report["compilation"]["cold_s"] > 0 and report["compilation"]["warm_s"] > 0
    assert "wrote" in proc.stdout
