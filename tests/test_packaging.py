"""Packaging: the wheel holds only `jaxpaged`; the other top-level folders map into it."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_puts_only_jaxpaged_at_top_level(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    (wheel,) = tmp_path.glob("jaxpaged-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"jaxpaged", next(t for t in tops if t.endswith(".dist-info"))}
    for module in ("jaxpaged/models/llama.py", "jaxpaged/pallas_kernels/reference.py",
                   "jaxpaged/server/__init__.py", "jaxpaged/entrypoints/llm.py",
                   "jaxpaged/pallas_kernels/csrc/paged_attention_cpu.cc",
                   "jaxpaged/pallas_kernels/csrc/int8_matmul_cpu.cc"):
        assert module in names
    # Every subsystem folder of jaxpaged/ is a package of the wheel (pyproject lists them).
    for init in (ROOT / "jaxpaged").rglob("__init__.py"):
        assert init.relative_to(ROOT).as_posix() in names, init

    # Installed from the wheel (ahead of the editable install on sys.path), it imports.
    target = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                          str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    code = ("import jaxpaged.models, jaxpaged.pallas_kernels, jaxpaged.server, sys;"
            "from jaxpaged import LLM;"
            "from jaxpaged.pallas_kernels import cpu_attention;"
            "assert all(p.is_file() for p in (*cpu_attention._SOURCES, *cpu_attention._HEADERS));"
            "assert jaxpaged.models.__file__.startswith(sys.argv[1]), jaxpaged.models.__file__")
    res = subprocess.run([sys.executable, "-c", code, str(target)], cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


def test_editable_install_imports_without_claiming_generic_names(tmp_path):
    code = ("import importlib.util, jaxpaged.models, jaxpaged.pallas_kernels, jaxpaged.server;"
            "from jaxpaged import LLM, SamplingParams;"
            "assert importlib.util.find_spec('models') is None;"
            "assert importlib.util.find_spec('server') is None;"
            "assert importlib.util.find_spec('pallas_kernels') is None")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
