"""The engine end to end on the tiny random Llama: batching, preemption, inputs, errors."""

import pytest

from jaxpaged import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def record_steps(engine):
    """Wraps the scheduler so each step's SchedulerOutput is kept, in order."""
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append(out)
        return out

    engine.scheduler.schedule = recording
    return steps


def test_continuous_batching_admits_waiting_request_the_step_after_one_finishes(make_llm,
                                                                                 tiny_model_dir):
    llm = make_llm(tiny_model_dir, max_num_seqs=2)
    engine = llm.llm_engine
    steps = record_steps(engine)
    lengths = {"a": 3, "b": 9, "c": 5, "d": 4}
    for rid, n in lengths.items():
        engine.add_request(f"prompt {rid} " * 3, SamplingParams(temperature=0, max_tokens=n,
                                                               ignore_eos=True), request_id=rid)
    finished_at, outputs = {}, {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished_at[out.request_id] = step
                outputs[out.request_id] = out
        assert len(engine.scheduler.running) <= 2
        step += 1

    for rid, n in lengths.items():
        assert len(outputs[rid].outputs[0].token_ids) == n
        assert outputs[rid].outputs[0].finish_reason == "length"
    def prefilled_in(step):  # request ids whose prompt this step computes
        return [s.request_id for s, q in zip(step.seqs, step.num_scheduled_tokens) if q > 1]

    assert prefilled_in(steps[0]) == ["a", "b"]
    # a (3 tokens) finishes first; c is prefilled in the very next step, beside b's decode;
    # d likewise after c ends.
    assert finished_at["a"] < finished_at["c"]
    assert prefilled_in(steps[finished_at["a"] + 1]) == ["c"]
    assert [s.request_id for s in steps[finished_at["a"] + 1].seqs] == ["b", "c"]
    assert prefilled_in(steps[finished_at["c"] + 1]) == ["d"]
    assert all(len(s.seqs) <= 2 for s in steps)


def test_preemption_keeps_outputs_unchanged(make_llm, tiny_model_dir):
    """Greedy outputs only: a preempted sequence computes its K/V again in a prefill, with other
    matmul shapes than the decode steps that first computed them, so its logits agree to about
    1e-6, not bit for bit, and a seeded draw that lands near a boundary of the distribution can
    flip (it did, for a temperature-1 request, on one of our machines)."""
    prompts = [f"request number {i} asks for a rather long answer" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # 16 blocks of 4 tokens: one sequence (about 50 tokens) fits alone, four together do not;
    # no prefix cache, so that the batch computes its prompts as each did alone
    small = make_llm(tiny_model_dir, block_size=4, num_kv_blocks=16, max_model_len=64,
                     enable_prefix_caching=False)
    want = [small.generate(p, params, use_tqdm=False)[0] for p in prompts]
    assert small.stats()["num_preemptions"] == 0
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text


def test_batched_greedy_equals_each_prompt_alone(tiny_llm):
    prompts = ["a", "two words", "a somewhat longer prompt with more tokens in it"]
    batched = tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, batched):
        alone = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_prompt_forms_order_and_text(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    ids = tokenizer("token ids given directly").input_ids
    prompts = ["first", {"prompt_token_ids": ids}, "third prompt"]
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), GREEDY]
    outs = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == ["first", None, "third prompt"]
    assert outs[1].prompt_token_ids == ids
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 3, 8]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.index == 0 and c.finish_reason == "length"
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    single = tiny_llm.generate("first", GREEDY, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_seeded_request_is_reproducible_alone_and_batched(tiny_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10,
                            ignore_eos=True)
    alone = tiny_llm.generate("seeded prompt", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True)] * 7
    batch = tiny_llm.generate(["seeded prompt"] + [f"other {i}" for i in range(7)],
                              [seeded] + others, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    again = tiny_llm.generate("seeded prompt", seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    draws = {tuple(tiny_llm.generate("seeded prompt", unseeded, use_tqdm=False)[0]
                   .outputs[0].token_ids) for _ in range(3)}
    assert len(draws) > 1  # unseeded requests differ from one another


def test_n_completions_and_stop_token(tiny_llm):
    out = tiny_llm.generate("n of them", SamplingParams(n=3, temperature=1.0, seed=3,
                                                        max_tokens=5, ignore_eos=True),
                            use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    first = tiny_llm.generate("stop here", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = first[3]
    out = tiny_llm.generate("stop here", SamplingParams(temperature=0, max_tokens=8,
                                                        stop_token_ids=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert out.token_ids == first[:first.index(stop) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_generation_stops_at_max_model_len(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    ids = tokenizer("word " * 100).input_ids[:250]
    out = tiny_llm.generate({"prompt_token_ids": ids},
                            SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert len(ids) + len(out.token_ids) == 256 and out.finish_reason == "length"


def test_chat_applies_the_template(tiny_llm):
    out = tiny_llm.chat([{"role": "user", "content": "Hello there"}], GREEDY, use_tqdm=False)[0]
    assert "<|im_start|>user\nHello there<|im_end|>" in out.prompt
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.parametrize("call, bad_value", [
    (lambda llm: llm.generate("", GREEDY), "empty"),
    (lambda llm: llm.generate("word " * 300, GREEDY), "max_model_len=256"),
    (lambda llm: llm.generate({"prompt_token_ids": [5, 49152]}, GREEDY), "49152"),
    (lambda llm: llm.generate(["fine", ""], GREEDY), "empty"),
    (lambda llm: llm.generate("hi", SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda llm: llm.generate("hi", SamplingParams(temperature=-0.5)), "-0.5"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=0)), "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "1.5"),
    (lambda llm: llm.generate(["a", "b"], [GREEDY]), "1 sampling params for 2 prompts"),
    (lambda llm: llm.generate(["a", "b"], [GREEDY, {"temperature": 0}]), "temperature"),
    (lambda llm: llm.generate([{"prompt_token_ids": []}], GREEDY), "no tokens"),
    (lambda llm: llm.generate([3], GREEDY), "int"),
    (lambda llm: llm.chat([], GREEDY), "messages is empty"),
])
def test_bad_input_raises_value_error_and_engine_stays_usable(tiny_llm, call, bad_value):
    with pytest.raises(ValueError, match=bad_value.replace("(", r"\(")):
        call(tiny_llm)
    stats = tiny_llm.stats()
    assert stats["num_waiting"] == stats["num_running"] == 0
    out = tiny_llm.generate("still works", GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


def test_unknown_model_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="no/such/model.*Supported"):
        LLM("no/such/model")
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(tmp_path)


def test_generation_config_eos_ids_and_a_bad_one_named(tiny_model_dir, tmp_path):
    """`generation_config.json`'s eos_token_id (an id or a list) joins the stop ids; a file
    that is not a JSON object is a ValueError naming it."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    llm = LLM(model, max_model_len=64, num_kv_blocks=16, precompile=False)
    assert {2, 7} <= llm.llm_engine.eos_token_ids
    del llm
    (model / "generation_config.json").write_text("[2, 7]")
    with pytest.raises(ValueError, match="generation_config.json is not a JSON object"):
        LLM(model, max_model_len=64, num_kv_blocks=16, precompile=False)
