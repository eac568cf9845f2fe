"""Priority scheduling (`scheduling_policy="priority"`, vLLM's semantics): lower `priority`
first, ties by arrival; a high-priority arrival preempts lower-priority running requests."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from server_utils import ServerThread

from jaxpaged import SamplingParams
from jaxpaged.config import SchedulerConfig


def _finish_order(llm, requests) -> list[str]:
    """Steps `llm`'s engine with `requests` [(name, priority, max_tokens, step to add it at)];
    the names in the order their requests finished."""
    engine, order, names, step = llm.llm_engine, [], {}, 0
    pending = sorted(requests, key=lambda r: r[3])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            name, priority, max_tokens, _ = pending.pop(0)
            rid = engine.add_request(f"Request {name}", SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True), priority=priority)
            names[rid] = name
        order += [names[o.request_id] for o in engine.step() if o.finished]
        step += 1
    return order


def test_high_priority_arrival_preempts_and_finishes_first(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, max_num_seqs=2, scheduling_policy="priority")
    order = _finish_order(llm, [("low1", 5, 30, 0), ("low2", 5, 30, 0), ("low3", 5, 30, 0),
                                ("high", 0, 4, 3)])
    assert order[0] == "high", order
    assert llm.stats()["num_preemptions"] >= 1
    # ties go by arrival: low1 and low2 were admitted first and low3 waited
    assert order.index("low3") > order.index("low1")


def test_waiting_requests_run_by_priority(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, max_num_seqs=1, scheduling_policy="priority")
    order = _finish_order(llm, [("c", 3, 3, 0), ("a", 1, 3, 0), ("b", 2, 3, 0),
                                ("a2", 1, 3, 0)])
    # all four arrive before the first step: lowest priority value first, ties by arrival
    assert order == ["a", "a2", "b", "c"]


def test_priority_needs_the_priority_policy(tiny_llm):
    with pytest.raises(ValueError, match="priority 1 needs a scheduling policy that reads it"):
        tiny_llm.generate(["Hi"], SamplingParams(max_tokens=2), priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerConfig(max_model_len=64, scheduling_policy="lifo")


def test_generate_takes_priorities(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, max_num_seqs=1, scheduling_policy="priority")
    outs = llm.generate(["one", "two"], SamplingParams(max_tokens=3, temperature=0),
                        priority=[2, 1], use_tqdm=False)
    assert [o.prompt for o in outs] == ["one", "two"]  # in input order
    assert outs[1].metrics.finished_time <= outs[0].metrics.first_scheduled_time
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(["one", "two"], priority=[1], use_tqdm=False)


def test_server_priority_through_openai_client(tiny_model_dir):
    """Under load, a high-priority request sent last finishes before the low-priority ones
    sent before it; a priority under the fcfs policy is a 400 naming `priority`."""
    from jaxpaged import LLM

    llm = LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=256, max_num_seqs=2,
              precompile=False, scheduling_policy="priority")
    with ServerThread(llm, "tiny") as server:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        done = {}

        async def ask(name, priority, max_tokens, after_load):
            while after_load:  # until both seats are taken and a request waits
                s = await asyncio.to_thread(server.stats)
                if s["num_requests_running"] == 2 and s["num_requests_waiting"] >= 1:
                    break
                await asyncio.sleep(0.005)
            await client.completions.create(model="tiny", prompt=f"Request {name}",
                                            max_tokens=max_tokens, temperature=0,
                                            extra_body={"priority": priority,
                                                        "ignore_eos": True})
            done[name] = time.monotonic()

        async def main():
            await asyncio.gather(*[ask(f"low{i}", 5, 200, False) for i in range(3)],
                                 ask("high", 0, 4, True))

        asyncio.run(main())
        assert min(done, key=done.get) == "high", done
    fcfs = LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=64, precompile=False)
    with ServerThread(fcfs, "tiny") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=2,
                                      extra_body={"priority": 1})
        assert e.value.body["param"] == "priority"


def test_block_pressure_never_preempts_a_sequence_already_in_the_step(tiny_model_dir, make_llm):
    """A high-priority sequence admitted after a low one and short of blocks preempts the low
    one only before the low one is in the step's batch: both finish as they do alone."""
    llm = make_llm(tiny_model_dir, max_model_len=16, num_kv_blocks=4, block_size=4,
                   max_num_seqs=4, scheduling_policy="priority")
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = {"low": [11, 12, 13, 14, 15], "high": [21, 22, 23, 24, 25, 26, 27, 28]}
    engine.add_request({"prompt_token_ids": prompts["low"]}, params, "low", priority=1)
    engine.step()
    engine.add_request({"prompt_token_ids": prompts["high"]}, params, "high", priority=0)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    for name, ids in prompts.items():
        [alone] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        assert done[name].finish_reason == "length"
        assert done[name].token_ids == alone.outputs[0].token_ids
    assert llm.stats()["num_preemptions"] >= 1
