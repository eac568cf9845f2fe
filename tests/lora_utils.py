"""Shared by the LoRA tests (tests/test_lora.py, tests/test_lora_adapters.py): peft adapters
written on a tiny base, peft's reference log-probabilities, and a batch mixing three adapters
and the base model."""

import numpy as np
import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

from jaxpaged import LoRARequest, SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, targets, rsLoRA) of the three adapters
ADAPTERS = {"a1": (8, 16, ALL, False), "a2": (4, 8, ["q_proj", "v_proj"], False),
            "a3": (16, 8, ["k_proj", "o_proj", "up_proj", "down_proj"], True)}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
           [30, 31, 32], [40, 41, 42, 43, 44, 45, 46], [50, 51, 52, 53, 54, 55, 56, 57, 58]]
MAX_NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)


def save_adapter(base, path, rank, alpha, targets, rslora, seed):
    """Writes a peft LoRA adapter of `base` (random A and B, B scaled up) to folder `path`."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(base, config)
    with torch.no_grad():  # init_lora_weights=False draws B too; make the change visible
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    model.save_pretrained(path)
    model.unload()  # takes the LoRA layers out of `base` again


def hf_logprobs(base, folders, adapter, prompt, output):
    """log p(output[t] | prompt + output[:t]) and the argmax at each position, by peft."""
    if adapter is None:
        model = base
    else:
        model = PeftModel.from_pretrained(base, folders[adapter]).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    if adapter is not None:
        model.unload()
    logprobs = torch.log_softmax(logits.double(), -1)
    return (logprobs[torch.arange(len(output)), output].numpy(),
            logprobs.argmax(-1).tolist())


def requests(folders):
    """(prompt, LoRARequest or None) of `PROMPTS` under the base model, a1, a2 and a3."""
    names = [None, "a1", "a2", "a3"]
    return [(prompt, None if name is None else LoRARequest(name, i + 1, str(folders[name])))
            for prompt, (i, name) in zip(PROMPTS, enumerate(names))]


def peft_tensors(folder):
    """The adapter's tensors by peft's names, as numpy arrays."""
    from safetensors.numpy import load_file
    return load_file(folder / "adapter_model.safetensors")


def mixed(llm, folders):
    """`requests(folders)` in one batch: [(prompt, adapter name, ids, sampled logprobs)]."""
    reqs = requests(folders)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], GREEDY, use_tqdm=False,
                        lora_request=[lora for _, lora in reqs])
    return [(p, lora and lora.lora_name, list(o.outputs[0].token_ids),
             [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for (p, lora), o in zip(reqs, outs)]


def check_against(base, folders, results, atol=1e-4):
    """Each of `mixed`'s results is peft's greedy choice, with peft's logprobs within atol."""
    for prompt, name, ids, got in results:
        want, argmax = hf_logprobs(base, folders, name, prompt, ids)
        assert ids == argmax, (name, ids, argmax)
        np.testing.assert_allclose(got, want, atol=atol)


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory, tiny_model_dir):
    """(HF tiny Llama, {a1, a2, a3: adapter folder}) of `ADAPTERS`."""
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    path = tmp_path_factory.mktemp("llama-adapters")
    folders = {}
    for seed, (adapter, spec) in enumerate(ADAPTERS.items()):
        folders[adapter] = path / adapter
        save_adapter(base, folders[adapter], *spec, seed=seed + 60)
    return base, folders
