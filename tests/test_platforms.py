"""The platform layer (`jaxpaged.platforms`) and the environment (`jaxpaged.envs`): one place
asks jax for its backend and reads environment variables; the platform decides the defaults."""

import dataclasses
import re
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxpaged import envs
from jaxpaged.pallas_kernels import KernelPlan
from jaxpaged.platforms import (CpuPlatform, CudaPlatform, current_platform, platform_for,
                                resolve_dtype)

ROOT = Path(__file__).resolve().parent.parent


def test_the_environment_and_the_backend_are_read_in_envs_and_platforms_only():
    pattern = re.compile(r"os\.environ|getenv\(|default_backend\(")
    allowed = {ROOT / "jaxpaged" / "envs.py", *(ROOT / "jaxpaged" / "platforms").rglob("*.py")}
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("jaxpaged", "server", "models", "pallas_kernels")
        for path in sorted((ROOT / folder).rglob("*.py")) if path not in allowed
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)]
    assert offenders == []


def test_kernels_import_nothing_of_jaxpaged_but_kernels():
    imports = re.compile(r"^\s*(from|import)\s+jaxpaged(\.\w+)?", re.M)
    offenders = [f"{path.name}: {m.group(0).strip()}"
                 for path in sorted((ROOT / "pallas_kernels").rglob("*.py"))
                 for m in imports.finditer(path.read_text(encoding="utf-8"))
                 if m.group(2) != ".pallas_kernels"]
    assert offenders == []


def test_this_machine_is_the_cpu_platform():
    platform = current_platform()
    assert isinstance(platform, CpuPlatform) and platform is current_platform()
    assert resolve_dtype("auto") == jnp.float32
    assert resolve_dtype("bfloat16") == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype 'float64' is not supported"):
        resolve_dtype("float64")
    assert platform.attention_backend("auto") in ("cpu", "xla")
    assert platform.attention_backend("xla") == "xla"
    assert platform.batch_invariant_backend("auto") == platform.attention_backend("auto")
    assert platform.cache_folder_name().endswith("-cpu-" + platform.machine_id())


def test_cuda_defaults_bfloat16_and_the_pallas_kernels():
    platform = platform_for("gpu", "PJRT C API\ncuda 13000")
    assert isinstance(platform, CudaPlatform)
    assert platform.resolve_dtype("auto") == jnp.bfloat16
    assert platform.attention_backend("auto") == "pallas"
    assert platform.kernels() == frozenset()
    assert platform.kernel_plan(jnp.float32, False, False) == KernelPlan(attention="pallas")
    with pytest.raises(ValueError, match="batch_invariant=True is implemented on CPU only, "
                       "not on 'cuda'"):
        platform.batch_invariant_backend("auto")


@pytest.mark.parametrize("backend, version, name", [("tpu", "", "tpu"),
                                                    ("gpu", "rocm 6.2", "rocm"),
                                                    ("METAL", "", "METAL")])
def test_other_platforms_are_refused_by_name(backend, version, name):
    with pytest.raises(RuntimeError, match=f"does not support the '{name}' platform"):
        platform_for(backend, version)


def test_auto_attention_backend_is_the_platforms_to_resolve():
    from jaxpaged.pallas_kernels import make_attention_backend

    with pytest.raises(ValueError, match="'auto' is resolved by the platform"):
        make_attention_backend("auto")


def test_few_row_kernel_follows_the_platform_and_its_variable(monkeypatch):
    platform = CpuPlatform()
    monkeypatch.delenv("JAXPAGED_FEW_ROW_KERNEL", raising=False)
    on = platform.kernel_plan(jnp.float32, False, False).few_row_matmul
    assert on == ("few_row_matmul" in platform.kernels())
    assert not platform.kernel_plan(jnp.float32, False, True).few_row_matmul  # batch-invariant
    assert not platform.kernel_plan(jnp.bfloat16, False, False).few_row_matmul
    assert not platform.kernel_plan(jnp.float32, True, False).few_row_matmul  # tensor parallel
    monkeypatch.setenv("JAXPAGED_FEW_ROW_KERNEL", "0")
    assert not envs.few_row_kernel_enabled()
    assert not platform.kernel_plan(jnp.float32, False, False).few_row_matmul


def test_the_kernel_plan_names_every_kernel_once():
    platform = CpuPlatform()
    built = "few_row_matmul" in platform.kernels()
    plan = platform.kernel_plan(jnp.float32, False, False, "xla")
    assert plan.attention == "xla"
    assert (plan.quantized_matmul, plan.moe_experts, plan.lora_matmul) == (built,) * 3
    invariant = platform.kernel_plan(jnp.float32, False, True)
    assert invariant.attention == platform.batch_invariant_backend("auto")
    assert invariant.moe_experts == built and not invariant.lora_matmul  # MoE's stays
    assert not platform.kernel_plan(jnp.float32, True, False).quantized_matmul  # tp
    with pytest.raises(ValueError, match="'cpu' or 'xla' attention backend"):
        platform.kernel_plan(jnp.float32, False, True, "pallas")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.moe_experts = not plan.moe_experts


def test_envs_defaults_and_overrides(monkeypatch, tmp_path):
    for name in ("JAXPAGED_HOME", "JAXPAGED_COMPILATION_CACHE_DIR", "JAXPAGED_CPU_KERNEL",
                 "CXX", "XLA_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    assert envs.jaxpaged_home() == Path("~/.cache/jaxpaged").expanduser()
    assert envs.compilation_cache_dir() is None and envs.cxx() is None
    assert envs.cpu_kernel_enabled() and envs.xla_flags() == ""
    monkeypatch.setenv("JAXPAGED_HOME", str(tmp_path))
    monkeypatch.setenv("JAXPAGED_CPU_KERNEL", "0")
    assert envs.jaxpaged_home() == tmp_path and not envs.cpu_kernel_enabled()
    monkeypatch.setenv("XLA_FLAGS", "")  # recorded, so the flag added below is undone after
    envs.add_xla_flag("--xla_a=1")
    envs.add_xla_flag("--xla_a=1")
    assert envs.xla_flags() == "--xla_a=1"


def test_cpu_kernels_build_where_the_platform_says(monkeypatch, tmp_path):
    from jaxpaged.pallas_kernels import cpu_attention
    from jaxpaged.platforms.cpu import configure_kernels

    saved = dict(cpu_attention._settings)
    monkeypatch.setenv("JAXPAGED_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "my-c++")
    monkeypatch.setenv("JAXPAGED_CPU_KERNEL", "0")
    try:
        configure_kernels()
        assert cpu_attention._settings == dict(build_dir=tmp_path / "kernels",
                                               compiler="my-c++", enabled=False)
    finally:
        cpu_attention._settings.update(saved)
