"""Orbax checkpoints: `jaxpaged convert` from a Hugging Face folder or a GGUF, loaded by
`LLM(model=OUT)` with the same greedy ids; a checkpoint that does not match its config, or a
damaged one, is an error naming the tensor. (The sharded restore is tested on 8 devices in
test_tensor_parallel.py.)"""

from __future__ import annotations

import json
import shutil

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.entrypoints import cli
from jaxpaged.model_loader.model_store import DEFAULT_MODEL, EMBEDDED_MODELS

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def converted(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "tiny"
    assert cli.main(["convert", str(tiny_model_dir), str(out)]) == 0
    return out


def _ids(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_hf_folder_round_trip(make_llm, tiny_model_dir, converted):
    assert (converted / "params").is_dir() and not list(converted.glob("*.safetensors"))
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (converted / name).is_file(), name
    assert _ids(make_llm(converted)) == _ids(make_llm(tiny_model_dir))


def test_gguf_round_trip(make_llm, default_model_dir, tmp_path):
    """The default model's GGUF converted straight to orbax."""
    out = tmp_path / "smollm2"
    gguf = EMBEDDED_MODELS[DEFAULT_MODEL].find_gguf()
    assert cli.main(["convert", str(gguf), str(out)]) == 0
    assert _ids(make_llm(out)) == _ids(make_llm(default_model_dir))


def test_a_shape_that_does_not_match_the_config_is_named(converted, tmp_path):
    edited = tmp_path / "edited"
    shutil.copytree(converted, edited)
    config = json.loads((edited / "config.json").read_text())
    config["intermediate_size"] = 256
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tensor layers\.0\.mlp\.down_proj\.kernel has shape "
                       r"\(128, 64\), the config implies \(256, 64\)"):
        LLM(edited, precompile=False, max_model_len=256, num_kv_blocks=64)


def test_a_truncated_checkpoint_names_a_tensor(converted, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(converted, damaged)
    data = max((damaged / "params").rglob("*"), key=lambda p: p.stat().st_size if p.is_file()
               else 0)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(ValueError, match=r"orbax checkpoint .*: tensor \S+ cannot be read"):
        LLM(damaged, precompile=False, max_model_len=256, num_kv_blocks=64)


def test_convert_refuses_a_full_folder_and_a_missing_source(converted, tmp_path, capsys):
    assert cli.main(["convert", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["convert", str(converted), str(converted)]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
