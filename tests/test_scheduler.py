"""Scheduler driven by a fake runner: token budget, admission, prefix caching, preemption, abort, stops."""

from __future__ import annotations

import pytest
from engine_factories import EOS, FakeRunner, make_request, make_scheduler, run_to_completion, step

from vllm_lite.engine_core.request import RequestStatus
from vllm_lite.protocol.messages import FinishReason

BS = 4


def test_token_budget_chunks_prefill_and_serves_decodes_first() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(BS)
    sched.add_request(make_request("short", 3, max_tokens=10))
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"short": 3} and [o.req_id for o in outputs] == ["short"]

    sched.add_request(make_request("long", 20))
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}
    assert [r.req_id for r in out.new_reqs] == ["long"] and out.new_reqs[0].num_computed_tokens == 0
    assert [o.req_id for o in outputs] == ["short"]  # a partial prefill chunk samples nothing

    sched.add_request(make_request("late", 5))
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}  # running requests take the budget
    assert [(r.req_id, r.num_computed_tokens) for r in out.cached_reqs] == [("short", 4), ("long", 7)]

    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"short": 1, "long": 6, "late": 1}
    assert [o.req_id for o in outputs] == ["short", "long"]

    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"short": 1, "long": 1, "late": 4}
    assert [o.req_id for o in outputs] == ["short", "long", "late"]
    run_to_completion(sched, runner)


def test_max_num_seqs_limits_the_batch() -> None:
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(BS)
    for name in "abc":
        sched.add_request(make_request(name, 4, max_tokens=3))
    result = run_to_completion(sched, runner)
    assert all(len(s.num_scheduled_tokens) <= 2 for s in result.steps)
    assert list(result.steps[0].num_scheduled_tokens) == ["a", "b"]
    assert [r.req_id for r in result.steps[3].new_reqs] == ["c"]  # after a and b finished
    assert result.tokens == {name: [1000, 1001, 1002] for name in "abc"}


def test_admission_is_fcfs_without_skipping() -> None:
    sched = make_scheduler(num_blocks=8)
    runner = FakeRunner(BS)
    sched.add_request(make_request("big0", 18, max_tokens=2))  # holds 5 of 8 blocks
    step(sched, runner)
    sched.add_request(make_request("big1", 16))  # needs 4 blocks: does not fit yet
    sched.add_request(make_request("small", 3))  # would fit, but must not overtake big1
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"big0": 1}
    assert sched.get_stats().num_waiting == 2
    out, _ = step(sched, runner)  # big0 finished last step and freed its blocks
    assert out.finished_req_ids == ["big0"]
    assert [r.req_id for r in out.new_reqs] == ["big1", "small"]
    run_to_completion(sched, runner)


def test_prefix_cache_hit_shares_blocks_between_requests() -> None:
    sched = make_scheduler()
    runner = FakeRunner(BS)
    prefix = list(range(1, 9))
    sched.add_request(make_request("a", [*prefix, 50, 51], max_tokens=4))
    step(sched, runner)
    sched.add_request(make_request("b", [*prefix, 60], max_tokens=4))
    out, outputs = step(sched, runner)

    (new,) = out.new_reqs
    blocks_a = sched.kv_cache_manager.get_block_ids("a")
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens["b"] == 1
    assert new.block_ids[:2] == blocks_a[:2] and new.block_ids[2] not in blocks_a
    assert [sched.kv_cache_manager.pool.blocks[i].ref_cnt for i in blocks_a] == [2, 2, 1]
    assert {o.req_id: o.num_cached_tokens for o in outputs} == {"a": 0, "b": 8}
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (19, 8)
    run_to_completion(sched, runner)


def test_blocks_are_shared_only_once_computed() -> None:
    sched = make_scheduler()
    runner = FakeRunner(BS)
    for name in "ab":  # same prompt, same step: a's blocks have no KV yet when b is admitted
        sched.add_request(make_request(name, list(range(1, 10)), max_tokens=2))
    out, _ = step(sched, runner)
    assert [r.num_computed_tokens for r in out.new_reqs] == [0, 0]
    run_to_completion(sched, runner)


def test_full_prompt_hit_recomputes_the_last_block() -> None:
    sched = make_scheduler()
    runner = FakeRunner(BS)
    prompt = list(range(1, 9))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched, runner)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    out, outputs = step(sched, runner)
    assert out.new_reqs[0].num_computed_tokens == 4 and out.num_scheduled_tokens == {"b": 4}
    assert outputs[0].new_token_ids == [1000] and outputs[0].finished


def test_output_tokens_fill_shareable_blocks() -> None:
    sched = make_scheduler()
    runner = FakeRunner(BS)
    a = make_request("a", [1, 2, 3], max_tokens=6)
    sched.add_request(a)
    run_to_completion(sched, runner)
    # The last sampled token's KV was never computed, so 8 of a's 9 tokens are cached.
    sched.add_request(make_request("b", [*a.all_token_ids, 7]))
    out, _ = step(sched, runner)
    assert out.new_reqs[0].num_computed_tokens == 8


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_and_everything_finishes(prefix_caching: bool) -> None:
    # 6 blocks of 4 tokens; each request ends at 15 tokens (4 blocks): they cannot all run at once.
    sched = make_scheduler(num_blocks=6, enable_prefix_caching=prefix_caching)
    runner = FakeRunner(BS)
    for name in "abc":
        sched.add_request(make_request(name, 5, max_tokens=10))
    result = run_to_completion(sched, runner)

    preempted = [req_id for s in result.steps for req_id in s.preempted_req_ids]
    assert preempted[0] == "c"  # the latest arrival goes first
    assert sched.get_stats().num_preemptions == len(preempted) >= 2
    resumed = [r for s in result.steps for r in s.new_reqs if r.output_token_ids]
    assert {r.req_id for r in resumed} == set(preempted)
    for r in resumed:
        assert r.num_computed_tokens % BS == 0 and r.num_computed_tokens < 5 + len(r.output_token_ids)
    assert result.tokens == {name: list(range(1000, 1010)) for name in "abc"}
    assert set(result.finish_reasons.values()) == {FinishReason.LENGTH}


def test_a_request_can_preempt_itself() -> None:
    sched = make_scheduler(num_blocks=3)
    runner = FakeRunner(BS)
    sched.add_request(make_request("a", 6))  # 2 blocks
    sched.add_request(make_request("b", 4))  # 1 block, then needs a second one to decode
    sched.add_request(make_request("c", 4))  # no block left for it
    step(sched, runner)
    out, outputs = step(sched, runner)
    assert out.preempted_req_ids == ["b"] and out.num_scheduled_tokens == {"a": 1}
    assert [o.req_id for o in outputs] == ["a"]
    # The preempted request goes back to the head of the queue, ahead of later arrivals.
    assert [(r.req_id, r.status) for r in sched.waiting] == [
        ("b", RequestStatus.PREEMPTED),
        ("c", RequestStatus.WAITING),
    ]
    run_to_completion(sched, runner)


def test_no_admission_in_a_step_that_preempts() -> None:
    # 3 blocks, a budget of 3 tokens: when b preempts itself, a 2-token chunk of it would fit again.
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=3, enable_prefix_caching=False)
    runner = FakeRunner(BS)
    sched.add_request(make_request("a", 2))
    sched.add_request(make_request("b", 1))
    result = run_to_completion(sched, runner)
    preempting = [s for s in result.steps if s.preempted_req_ids]
    assert preempting and all(s.preempted_req_ids == ["b"] for s in preempting)
    assert all(s.new_reqs == [] and s.num_scheduled_tokens == {"a": 1} for s in preempting)


def test_abort_frees_blocks_at_once() -> None:
    sched = make_scheduler(num_blocks=16)
    runner = FakeRunner(BS)
    sched.add_request(make_request("run", 9, max_tokens=20))
    step(sched, runner)
    sched.add_request(make_request("wait", 5))
    assert sched.kv_cache_manager.num_free_blocks == 13

    outputs = sched.abort_requests(["run", "wait", "unknown", "run"])
    assert [(o.req_id, o.finish_reason, o.new_token_ids) for o in outputs] == [
        ("run", FinishReason.ABORT, []),
        ("wait", FinishReason.ABORT, []),
    ]
    assert sched.kv_cache_manager.num_free_blocks == 16 and not sched.has_unfinished_requests()
    out, _ = step(sched, runner)
    assert out.finished_req_ids == ["run"]  # the runner never saw "wait"
    assert not runner.requests


def test_abort_between_schedule_and_update_drops_the_token() -> None:
    sched = make_scheduler(num_blocks=16)
    runner = FakeRunner(BS)
    sched.add_request(make_request("a", 5))
    sched.add_request(make_request("b", 5))
    out = sched.schedule()
    runner_output = runner.execute(out)
    sched.abort_requests(["a"])
    outputs = sched.update_from_output(out, runner_output)
    assert [o.req_id for o in outputs] == ["b"]
    assert sched.kv_cache_manager.num_free_blocks == 14
    assert step(sched, runner)[0].finished_req_ids == ["a"]
    run_to_completion(sched, runner)


def test_abort_of_a_preempted_request_is_not_reported_to_the_runner() -> None:
    sched = make_scheduler(num_blocks=3)
    runner = FakeRunner(BS)
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("b", 4))
    step(sched, runner)
    assert step(sched, runner)[0].preempted_req_ids == ["b"]
    sched.abort_requests(["b"])
    assert step(sched, runner)[0].finished_req_ids == []
    run_to_completion(sched, runner)


@pytest.mark.parametrize(
    ("params", "script", "expected", "reason", "stop_reason"),
    [
        ({}, [5, EOS, 7], [5, EOS], FinishReason.STOP, EOS),
        ({"max_tokens": 3, "ignore_eos": True}, [EOS, EOS, EOS], [EOS] * 3, FinishReason.LENGTH, None),
        ({"stop_token_ids": [7]}, [5, 7, 8], [5, 7], FinishReason.STOP, 7),
        ({"min_tokens": 3, "stop_token_ids": [7]}, [EOS, 7, EOS, 9], [EOS, 7, EOS], FinishReason.STOP, EOS),
        ({"max_tokens": 4}, [], [1000, 1001, 1002, 1003], FinishReason.LENGTH, None),
        ({"max_tokens": 2}, [5, EOS], [5, EOS], FinishReason.STOP, EOS),  # a stop token beats the length
        ({"max_tokens": None}, [], [1000, 1001, 1002, 1003], FinishReason.LENGTH, None),  # max_model_len 10
    ],
)
def test_stop_conditions(
    params: dict, script: list[int], expected: list[int], reason: FinishReason, stop_reason: int | None
) -> None:
    sched = make_scheduler(max_model_len=10)
    runner = FakeRunner(BS, scripts={"r": script})
    sched.add_request(make_request("r", 6, max_model_len=10, **params))
    result = run_to_completion(sched, runner)
    assert result.tokens["r"] == expected
    final = result.outputs["r"][-1]
    assert (final.finish_reason, final.stop_reason) == (reason, stop_reason)
    assert all(not o.finished for o in result.outputs["r"][:-1])


def test_kv_capacity_caps_the_sequence_length() -> None:
    sched = make_scheduler(num_blocks=3, max_model_len=64)  # 12 tokens of KV in all
    runner = FakeRunner(BS)
    sched.add_request(make_request("r", 6, max_tokens=None))
    result = run_to_completion(sched, runner)
    assert len(result.tokens["r"]) == 6 and result.finish_reasons["r"] == FinishReason.LENGTH


def test_logprobs_are_passed_through() -> None:
    sched = make_scheduler()
    runner = FakeRunner(BS)
    sched.add_request(make_request("with", 3, max_tokens=2, logprobs=1))
    sched.add_request(make_request("without", 3, max_tokens=2))
    result = run_to_completion(sched, runner)
    assert [o.new_logprobs[0].token_id for o in result.outputs["with"]] == [1000, 1001]
    assert all(o.new_logprobs is None for o in result.outputs["without"])


def test_add_request_rejects_what_can_never_run() -> None:
    sched = make_scheduler(num_blocks=2, max_model_len=10)  # 8 tokens of KV
    with pytest.raises(ValueError, match="max_model_len=10"):
        sched.add_request(make_request("too-long", 10, max_model_len=10))
    with pytest.raises(ValueError, match="KV cache"):
        sched.add_request(make_request("too-big", 8, max_model_len=10))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("empty", [], max_model_len=10))
    sched.add_request(make_request("fits", 7, max_model_len=10))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("fits", 3, max_model_len=10))
    assert sched.get_num_unfinished_requests() == 1


def test_stats_snapshot() -> None:
    sched = make_scheduler(num_blocks=10, max_num_seqs=1)
    runner = FakeRunner(BS)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 8))
    step(sched, runner)
    stats = sched.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (1, 1, 0.2)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (8, 0, 0)
