"""`jaxpaged run-batch` and `jaxpaged replay` on the tiny random Llama: the OpenAI Batch file
format, bad lines as error lines, the manifest, and a replay that is identical, that refuses a
changed model file, and that names the request whose recorded seed changed."""

import json
import shutil

import pytest

from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.entrypoints import cli
LINES = [
    {"custom_id": "greedy", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8,
              "temperature": 0, "logprobs": 2}},
    "this line is not JSON",
    {"custom_id": "sampled", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12,
              "temperature": 1.0, "logprobs": 1}},
    {"custom_id": "bad-temperature", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": "x", "temperature": -1}},
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi!"}],
              "max_tokens": 6, "seed": 3}},
    {"custom_id": "seeded", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 5, "seed": 11}},
]
ENGINE = ["--batch-invariant", "--no-precompile", "--max-model-len", "128", "--num-kv-blocks",
          "64", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def batch_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    model = root / "model"
    shutil.copytree(tiny_model_dir, model)
    src = root / "requests.jsonl"
    src.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                           for line in LINES))
    out = root / "results.jsonl"
    assert cli.main(["run-batch", "-i", str(src), "-o", str(out), "--model", str(model),
                     *ENGINE]) == 0
    return model, src, out, root / "results.jsonl.manifest.json"


def test_results_and_error_lines(batch_run):
    _, _, out, _ = batch_run
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [None if isinstance(line, str)
                                                 else line["custom_id"] for line in LINES]
    by_id = {r["custom_id"]: r for r in results}
    assert results[1]["response"]["status_code"] == 400 and "not JSON" in results[1]["error"]
    bad = by_id["bad-temperature"]
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "temperature"
    for custom_id in ("greedy", "sampled", "chat", "seeded"):
        r = by_id[custom_id]
        assert r["error"] is None and r["response"]["status_code"] == 200, r
        assert r["response"]["body"]["choices"], r
    assert by_id["chat"]["response"]["body"]["object"] == "chat.completion"


def test_the_manifest(batch_run):
    model, src, out, manifest_path = batch_run
    manifest = json.loads(manifest_path.read_text())
    assert manifest["versions"]["jax"] and manifest["versions"]["jaxpaged"]
    assert manifest["devices"]["count"] >= 1 and manifest["attention_backend"] in ("cpu", "xla")
    assert manifest["dtype"] == "float32" and manifest["engine_options"]["batch_invariant"]
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(manifest["model_files"])
    assert manifest["input"]["sha256"] and manifest["output"]["sha256"]
    # each request's effective seed: its own, or the run's seed (0) plus its line index
    assert manifest["request_seeds"] == {"greedy": 0, "sampled": 2, "chat": 3, "seeded": 11}
    assert manifest["num_requests"] == 6 and manifest["num_errors"] == 2
    # every engine option, as EngineArgs reads it back: the flags given and the defaults
    assert EngineArgs.from_dict(manifest["engine_options"]) == EngineArgs(
        model=str(model), batch_invariant=True, precompile=False, max_model_len=128,
        num_kv_blocks=64)


def test_replay_is_identical(batch_run, capsys):
    _, _, _, manifest = batch_run
    assert cli.main(["replay", str(manifest)]) == 0
    assert capsys.readouterr().out.strip().endswith("identical 6/6")


def test_replay_takes_engine_flags_over_the_recorded_options(batch_run, tmp_path, capsys):
    """A flag given to replay replaces the recorded option (with a warning); batch invariance
    makes fewer sequences per step give the same results."""
    _, _, _, manifest = batch_run
    with pytest.warns(UserWarning, match="'max_num_seqs': 2"):
        assert cli.main(["replay", str(manifest), "--max-num-seqs", "2", "-o",
                         str(tmp_path / "replayed.jsonl")]) == 0
    assert capsys.readouterr().out.strip().endswith("identical 6/6")


def test_replay_names_the_request_whose_seed_changed(batch_run, tmp_path, capsys):
    _, _, _, manifest_path = batch_run
    manifest = json.loads(manifest_path.read_text())
    manifest["request_seeds"]["sampled"] = 12345
    changed = tmp_path / "changed.manifest.json"
    changed.write_text(json.dumps(manifest))
    assert cli.main(["replay", str(changed), "-o", str(tmp_path / "replayed.jsonl")]) == 1
    message = capsys.readouterr().out
    assert "differs at custom_id 'sampled'" in message and "token" in message


def test_replay_refuses_a_changed_model_file(batch_run, capsys):
    model, _, _, manifest = batch_run
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one byte of the last tensor
    weights.write_bytes(bytes(data))
    assert cli.main(["replay", str(manifest)]) == 2
    assert "model.safetensors: its sha256 differs" in capsys.readouterr().err
