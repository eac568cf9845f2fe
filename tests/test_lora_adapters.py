"""LoRA adapters' lifecycle: adapters load, reload and change slots with no compilation;
`update_lora` from device arrays, PEFT-named or a qwix tree; a reloaded adapter never reuses
its old version's cached blocks; more adapters than `max_loras` at once all finish; bad
folders and requests are refused by name; the server loads and serves adapters by model name;
`run-batch` records them; adapters survive a sleep. Parity with peft is tests/test_lora.py's."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from lora_utils import (ALL, GREEDY, MAX_NEW_TOKENS, PROMPTS, hf_logprobs, peft_tensors,
                        save_adapter)
from lora_utils import llama_adapters  # noqa: F401 (a fixture)

from conftest import TINY_CONFIG
from jaxpaged import LoRARequest

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # one per executable compiled


@pytest.fixture
def compiles():
    """A list of the XLA compilations (JAX's own event, one per executable) while the test
    runs."""
    events = []

    def listen(event, secs, **kwargs):
        if event == COMPILE_EVENT:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield events
    jax.monitoring.unregister_event_duration_listener(listen)


def test_load_reload_and_slot_changes_compile_nothing(tiny_model_dir, tmp_path, make_llm,
                                                      compiles):
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    folders = {}
    for seed, name in enumerate(["x", "y", "z"]):
        folders[name] = tmp_path / name
        save_adapter(base, folders[name], 8, 16, ALL, False, seed=seed + 10)
    llm = make_llm(tiny_model_dir, enable_lora=True, max_loras=1, max_lora_rank=8,
                   max_cpu_loras=3, precompile=[8, 16, 32, 64])
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    x = LoRARequest("x", 1, str(folders["x"]))
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=x)  # warm the sampler
    compiles.clear()
    for name in ["y", "z", "x"]:  # each takes the one slot in turn
        llm.add_lora(LoRARequest(name, 1, str(folders[name])))
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest(name))
    tensors = {k: v * 0.5 for k, v in peft_tensors(folders["y"]).items()}
    llm.update_lora("y", tensors)
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("y"))
    assert llm.remove_lora("z") and not llm.remove_lora("z")
    assert compiles == []


def _qwix_tree(peft: dict, heads: int, head_dim: int) -> dict:
    """The qwix `nnx.LoRAParam` tree of a tunix Llama 3 (`layers.{i}.attn.q_proj.w_lora_a:
    f[D, r]`, `w_lora_b: f[r, N, H]`, `o_proj.w_lora_a: f[N, H, r]`, `mlp.*.kernel_lora_*`)
    holding the PEFT adapter `peft`, written out by hand from qwix's einsum rule."""
    tree: dict = {}
    for key, a in peft.items():
        m = re.match(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                     r"\.lora_A\.weight$", key)
        if m is None:
            continue
        layer, owner, proj = m.groups()
        b = peft[key.replace("lora_A", "lora_B")]
        r = a.shape[0]
        if proj in ("q_proj", "k_proj", "v_proj"):
            la, lb, name = a.T, b.T.reshape(r, -1, head_dim), "w"
        elif proj == "o_proj":
            la, lb, name = a.T.reshape(heads, head_dim, r), b.T, "w"
        else:
            la, lb, name = a.T, b.T, "kernel"
        node = tree.setdefault("layers", {}).setdefault(int(layer), {}).setdefault(
            "attn" if owner == "self_attn" else "mlp", {}).setdefault(proj, {})
        node[f"{name}_lora_a"], node[f"{name}_lora_b"] = jnp.asarray(la), jnp.asarray(lb)
    return tree


def test_update_lora_from_device_arrays_and_a_qwix_tree(tiny_model_dir, tmp_path, make_llm,
                                                       compiles):
    """`update_lora` from `jax.Array`s, PEFT-named or as a qwix tree of a tunix Llama 3: the
    same adapter either way (its outputs equal to the folder's), with no transfer between host
    and device (tunix's guards), and a second update of the same layout compiles nothing."""
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    save_adapter(base, tmp_path / "a", 8, 16, ALL, False, seed=31)
    llm = make_llm(tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    run = lambda name: llm.generate(prompt, GREEDY, use_tqdm=False,
                                    lora_request=LoRARequest(name))[0].outputs[0]
    llm.add_lora(LoRARequest("folder", 1, str(tmp_path / "a")))
    want = run("folder")
    peft = peft_tensors(tmp_path / "a")
    config = {"r": 8, "lora_alpha": 16}
    H = TINY_CONFIG["hidden_size"] // TINY_CONFIG["num_attention_heads"]
    for name, tensors in [("peft", {k: jnp.asarray(v) for k, v in peft.items()}),
                          ("qwix", _qwix_tree(peft, TINY_CONFIG["num_attention_heads"], H))]:
        with jax.transfer_guard_device_to_host("disallow_explicit"), \
                jax.transfer_guard_host_to_device("disallow_explicit"):
            llm.update_lora(name, tensors, config)
        got = run(name)
        assert got.token_ids == want.token_ids, name
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)],
                                   [lp[t].logprob for lp, t in zip(want.logprobs,
                                                                   want.token_ids)], atol=1e-5)
        halved = jax.tree.map(lambda x: x * 0.5, tensors)
        compiles.clear()
        llm.update_lora(name, halved, config)
        assert compiles == [], name  # its layout was compiled by the first update


def test_a_reloaded_adapter_never_reuses_its_old_blocks(tiny_model_dir, tmp_path, make_llm):
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    save_adapter(base, tmp_path / "v1", 8, 16, ALL, False, seed=21)
    save_adapter(base, tmp_path / "v2", 8, 16, ALL, False, seed=22)
    llm = make_llm(tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompt = [{"prompt_token_ids": list(range(5, 5 + 40))}]  # two full blocks and more
    v1 = LoRARequest("same", 1, str(tmp_path / "v1"))
    first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=v1)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=v1)[0]
    assert again.num_cached_tokens > 0  # the same version reuses its blocks
    llm.add_lora(LoRARequest("same", 1, str(tmp_path / "v2")))
    fresh = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("same"))[0]
    assert fresh.num_cached_tokens == 0
    base_out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert base_out.num_cached_tokens == 0  # nor does the base model reuse adapters' blocks
    want, _ = hf_logprobs(base, {"same": tmp_path / "v2"}, "same", prompt[0]["prompt_token_ids"],
                          list(fresh.outputs[0].token_ids))
    got = [next(iter(lp.values())).logprob for lp in fresh.outputs[0].logprobs]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert first.outputs[0].token_ids is not None


def test_more_adapters_than_slots_all_finish(tiny_model_dir, tmp_path, make_llm):
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    names = [f"n{i}" for i in range(5)]
    for i, name in enumerate(names):
        save_adapter(base, tmp_path / name, 4, 8, ["q_proj", "down_proj"], False, seed=30 + i)
    llm = make_llm(tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=4,
                   max_cpu_loras=3)
    loras = [LoRARequest(name, i + 1, str(tmp_path / name)) for i, name in enumerate(names)]
    prompts = [{"prompt_token_ids": PROMPTS[i % 4]} for i in range(10)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[loras[i % 5] for i in range(10)])
    for i, out in enumerate(outs):
        assert len(out.outputs[0].token_ids) == MAX_NEW_TOKENS
        want, argmax = hf_logprobs(base, {n: tmp_path / n for n in names}, names[i % 5],
                                   PROMPTS[i % 4], list(out.outputs[0].token_ids))
        assert list(out.outputs[0].token_ids) == argmax
    assert len(llm.list_loras()) == 3  # max_cpu_loras


def _write(folder, config, tensors=None):
    from safetensors.numpy import save_file
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, folder / "adapter_model.safetensors")


@pytest.mark.parametrize("change, match", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"r": 32}, "r=32 is above max_lora_rank=16"),
    ({"target_modules": ["embed_tokens"]}, "target_modules"),
    ({"peft_type": "IA3"}, "peft_type"),
])
def test_bad_adapter_configs_are_named(tiny_model_dir, tmp_path, make_llm, change, match):
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    save_adapter(base, tmp_path / "ok", 8, 16, ALL, False, seed=40)
    config = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    _write(tmp_path / "bad", {**config, **change}, peft_tensors(tmp_path / "ok"))
    llm = make_llm(tiny_model_dir, enable_lora=True, max_loras=1, max_lora_rank=16)
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("bad", 1, str(tmp_path / "bad")))
    out = llm.generate([{"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("ok", 1, str(tmp_path / "ok")))
    assert len(out[0].outputs[0].token_ids) == MAX_NEW_TOKENS  # the engine serves on


def test_bad_folders_tensors_and_requests_are_named(tiny_model_dir, tmp_path, make_llm):
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    save_adapter(base, tmp_path / "ok", 8, 16, ALL, False, seed=41)
    config = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    tensors = peft_tensors(tmp_path / "ok")
    llm = make_llm(tiny_model_dir, enable_lora=True, max_loras=1, max_lora_rank=16)
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    cases = {
        "is not a folder": tmp_path / "missing",
        "has no adapter_config.json": tmp_path / "empty",
        "lora_A .* expected": ({**tensors, key: tensors[key][:, :-1].copy()}),
        "no lora_B": {k: v for k, v in tensors.items()
                      if not (k.startswith(key.split("lora_A")[0]) and "lora_B" in k)},
        "is not a projection": {**tensors, "base_model.model.lm_head.lora_A.weight":
                                np.zeros((8, 64), np.float32),
                                "base_model.model.lm_head.lora_B.weight":
                                np.zeros((10, 8), np.float32)},
    }
    (tmp_path / "empty").mkdir()
    for i, (match, value) in enumerate(cases.items()):
        folder = value
        if isinstance(value, dict):
            folder = tmp_path / f"case{i}"
            _write(folder, config, value)
        with pytest.raises(ValueError, match=match):
            llm.add_lora(LoRARequest(f"case{i}", 1, str(folder)))
    with pytest.raises(ValueError, match="lora_path"):
        llm.generate([{"prompt_token_ids": [5]}], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("never-loaded"))
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("")
    with pytest.raises(ValueError, match="lora requests for"):
        llm.generate([{"prompt_token_ids": [5]}], GREEDY, use_tqdm=False,
                     lora_request=[None, None])
    with pytest.raises(ValueError, match=r"lora_A \[8, 3\]"):
        llm.update_lora("ok", {**tensors, key: np.zeros((8, 3), np.float32)}, config)
    assert llm.list_loras() == []  # nothing half-loaded


def test_lora_requests_need_enable_lora(tiny_llm):
    with pytest.raises(ValueError, match="enable_lora"):
        tiny_llm.generate([{"prompt_token_ids": [5]}], GREEDY, use_tqdm=False,
                          lora_request=LoRARequest("x", 1, "/nowhere"))
    with pytest.raises(ValueError, match="enable_lora"):
        tiny_llm.list_loras()


def test_the_server_serves_adapters_by_model_name(tiny_model_dir, tmp_path, make_llm):
    import httpx
    import openai

    from server_utils import ServerThread

    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    save_adapter(base, tmp_path / "s1", 8, 16, ALL, False, seed=50)
    llm = make_llm(tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    want = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                        lora_request=LoRARequest("s1", 1, str(tmp_path / "s1")))[0]
    llm.remove_lora("s1")
    with ServerThread(llm, "tiny", allow_runtime_lora_updating=True) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")

        def complete(model):
            return client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6,
                                             temperature=0)

        with pytest.raises(openai.NotFoundError):
            complete("s1")  # not loaded yet
        post = lambda route, body: httpx.post(f"{server.url}/v1/{route}", json=body)
        r = post("load_lora_adapter", {"lora_name": "s1", "lora_path": str(tmp_path / "s1")})
        assert r.status_code == 200, r.text
        assert [m.id for m in client.models.list().data] == ["tiny", "s1"]
        assert client.models.retrieve("s1").model_extra["parent"] == "tiny"
        got = complete("s1")
        assert got.choices[0].text == want.outputs[0].text
        assert complete("tiny").choices[0].text != got.choices[0].text
        # a name in use, a bad folder, a missing field: 400 naming the field
        for body, param in [({"lora_name": "s1", "lora_path": str(tmp_path / "s1")},
                             "lora_name"),
                            ({"lora_name": "s2", "lora_path": str(tmp_path / "nowhere")},
                             "lora_path"),
                            ({"lora_name": "s2"}, "lora_path")]:
            r = post("load_lora_adapter", body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = post("unload_lora_adapter", {"lora_name": "s2"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
        r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "s1", "input": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert post("unload_lora_adapter", {"lora_name": "s1"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete("s1")
        assert complete("tiny").choices[0].text  # the engine serves on


def test_run_batch_records_each_requests_adapter_and_replay_checks_its_files(
        tiny_model_dir, llama_adapters, tmp_path, capsys):
    from jaxpaged.entrypoints import cli

    _, folders = llama_adapters
    adapter = tmp_path / "a2"
    shutil.copytree(folders["a2"], adapter)
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/completions",
              "body": {"model": name, "prompt": [5, 6, 7, 8], "max_tokens": 5,
                       "temperature": 0}} for name in ("tiny", "a2")]
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    engine = ["--batch-invariant", "--no-precompile", "--max-model-len", "128",
              "--num-kv-blocks", "64", "--served-model-name", "tiny", "--enable-lora"]
    assert cli.main(["run-batch", "-i", str(src), "-o", str(out), "--model",
                     str(tiny_model_dir), "--lora-modules", f"a2={adapter}", *engine]) == 0
    results = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    texts = [results[name]["response"]["body"]["choices"][0]["text"] for name in ("tiny", "a2")]
    assert texts[0] != texts[1]
    manifest_path = tmp_path / "results.jsonl.manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["request_loras"] == {"a2": "a2"}
    files = manifest["lora_modules"]["a2"]["files"]
    assert manifest["lora_modules"]["a2"]["path"] == str(adapter)
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    assert cli.main(["replay", str(manifest_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("identical 2/2")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 1}))
    assert cli.main(["replay", str(manifest_path)]) == 2
    assert "adapter 'a2'" in capsys.readouterr().err


def test_adapters_are_written_back_after_the_weights_are_read_again(tiny_model_dir,
                                                                   llama_adapters, make_llm):
    _, folders = llama_adapters
    llm = make_llm(tiny_model_dir, enable_lora=True, max_loras=2)
    a1 = LoRARequest("a1", 1, str(folders["a1"]))
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    before = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a1)[0].outputs[0]
    llm.sleep(level=2)  # the weights, adapter slots included, are released and read again
    llm.wake_up()
    after = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a1)[0].outputs[0]
    assert after.token_ids == before.token_ids
    base = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    assert base.token_ids != before.token_ids
