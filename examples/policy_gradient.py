"""One step of RL post-training with the engine in the loop (the research API):

sample several completions of one prompt with the paged engine, score them with a reward,
take the log-probabilities of each completion (`completion_logprobs`), take one optax step of
REINFORCE with a baseline on the dense forward of the same parameters (`dense_forward`), hand
the new weights to the engine (`update_params`: no disk, no recompilation) and sample again.

The reward here is a toy: completions close to five words score higher. After the step the
completions with a positive advantage are more likely and the others less so, under the
engine's own scoring. Run it with `python examples/policy_gradient.py` (default model).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpaged import LLM, SamplingParams

NUM_SAMPLES = 8
MAX_TOKENS = 16
LEARNING_RATE = 2e-5


def reward(text: str) -> float:
    return -abs(len(text.split()) - 5)


start = time.perf_counter()
llm = LLM(max_model_len=256, max_num_seqs=NUM_SAMPLES, precompile=False)
prompt_ids = llm.get_tokenizer().apply_chat_template(
    [{"role": "user", "content": "Name a fruit and say one thing about it."}],
    add_generation_prompt=True, tokenize=True, return_dict=False)
sampling = SamplingParams(n=NUM_SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS, seed=0)


def sample() -> tuple[list[list[int]], np.ndarray]:
    out = llm.generate({"prompt_token_ids": prompt_ids}, sampling, use_tqdm=False)[0]
    return ([list(c.token_ids) for c in out.outputs],
            np.array([reward(c.text) for c in out.outputs], np.float32))


completions, rewards = sample()
advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
before = [lp.sum() for lp in llm.completion_logprobs(prompt_ids, completions)]

# The batch for the dense forward: prompt + completion, right-padded; the loss reads the
# completion tokens only.
P, L = len(prompt_ids), len(prompt_ids) + MAX_TOKENS
tokens = np.zeros((NUM_SAMPLES, L), np.int32)
mask = np.zeros((NUM_SAMPLES, L), bool)
for row, completion in enumerate(completions):
    tokens[row, :P + len(completion)] = prompt_ids + completion
    mask[row, :P + len(completion)] = True
scored = mask.copy()
scored[:, :P] = False  # positions whose token is a completion token


def loss_fn(params):
    logprobs = jax.nn.log_softmax(llm.dense_forward(params, tokens, mask)[:, :-1], axis=-1)
    token_lp = jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)[..., 0]
    per_completion = jnp.sum(token_lp * scored[:, 1:], axis=-1)
    return -jnp.mean(jnp.asarray(advantages) * per_completion)


params = llm.get_params()
optimizer = optax.adam(LEARNING_RATE)
loss, grads = jax.value_and_grad(loss_fn)(params)
updates, _ = optimizer.update(grads, optimizer.init(params), params)
llm.update_params(optax.apply_updates(params, updates))

after = [lp.sum() for lp in llm.completion_logprobs(prompt_ids, completions)]
print(f"{'reward':>6} {'advantage':>9} {'log p before':>12} {'after':>8}  completion")
for r, a, b, n, c in zip(rewards, advantages, before, after, completions):
    text = llm.get_tokenizer().decode(c, skip_special_tokens=True).replace("\n", " ")
    print(f"{r:6.0f} {a:9.2f} {b:12.2f} {n:8.2f}  {text[:60]!r}")
agree = np.mean(np.sign(np.array(after) - np.array(before)) == np.sign(advantages))
print(f"loss {float(loss):.3f}; log p moved with the advantage's sign for {agree:.0%} of them")
_, new_rewards = sample()
print(f"mean reward {rewards.mean():.2f} before the step, {new_rewards.mean():.2f} after "
      f"(one step, {NUM_SAMPLES} samples: noisy); {time.perf_counter() - start:.1f} s in all")
