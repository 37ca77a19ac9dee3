"""Block pool, KV cache manager and scheduler, without a model.

A fake model stands in for the forward: the next token of a sequence is a hash of all its
tokens, so any corruption of a request's state (lost, duplicated or reordered tokens, a
wrong number of computed tokens) changes its output.
"""

from __future__ import annotations

import random

import pytest

from specdec.config import SchedulerConfig
from specdec.engine.block_pool import NULL_BLOCK_ID, BlockPool
from specdec.engine.kv_cache_manager import KVCacheManager, cdiv
from specdec.engine.scheduler import Scheduler
from specdec.request import Request, RequestStatus
from specdec.sampling_params import SamplingParams

VOCAB = 1000


def fake_next_token(tokens: list[int]) -> int:
    return hash(tuple(tokens)) % VOCAB


def make_request(i: int, prompt: list[int], max_tokens: int) -> Request:
    return Request(
        request_id=str(i),
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
        max_tokens=max_tokens,
    )


def run(
    requests: list[Request],
    num_blocks: int,
    block_size: int = 4,
    max_num_seqs: int = 64,
    budget: int = 64,
    prefix_caching: bool = True,
) -> tuple[dict[str, list[int]], Scheduler]:
    """Drive the scheduler to completion, checking per-step invariants."""
    pool = BlockPool(num_blocks, prefix_caching)
    kv = KVCacheManager(pool, block_size)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget), kv, max_model_len=10_000)
    for r in requests:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_tokens <= budget
        assert len(sched.running) <= max_num_seqs
        assert len({id(s.request) for s in out.scheduled}) == len(out.scheduled)
        assert not out.is_empty, "scheduler stalled with unfinished requests"
        for s in out.scheduled:
            r = s.request
            assert NULL_BLOCK_ID not in r.block_ids
            assert len(r.block_ids) * block_size >= r.num_computed_tokens + s.num_new_tokens
        sched.update(out.scheduled)
        for s in out.scheduled:
            r = s.request
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(fake_next_token(r.all_token_ids))
                if r.num_output_tokens >= r.max_tokens:
                    sched.finish(r, RequestStatus.FINISHED_LENGTH)
        steps += 1
        assert steps < 100_000
    return {r.request_id: r.output_token_ids for r in requests}, sched


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        out.append(fake_next_token(tokens))
        tokens.append(out[-1])
    return out


def random_workload(seed: int, n: int = 32, shared_prefix: int = 0):
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    specs = []
    for i in range(n):
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        specs.append((i, prompt, rng.randint(1, 20)))
    return specs


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks", [400, 40, 17])
def test_outputs_match_reference_under_pressure(num_blocks, prefix_caching):
    specs = random_workload(seed=num_blocks, shared_prefix=9)
    requests = [make_request(*s) for s in specs]
    outputs, sched = run(requests, num_blocks, prefix_caching=prefix_caching)
    for i, prompt, max_tokens in specs:
        assert outputs[str(i)] == reference_output(prompt, max_tokens)
    pool = sched.kv.pool
    assert pool.num_free_blocks == num_blocks - 1  # everything returned but the null block
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    if num_blocks == 17:
        assert sched.num_preemptions > 0  # the small pool really forced preemption


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    requests = [make_request(0, list(range(5)), 10), make_request(1, list(range(100)), 3)]
    pool = BlockPool(200)
    sched = Scheduler(SchedulerConfig(8, 16), KVCacheManager(pool, 4), 10_000)
    sched.add_request(requests[0])
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [5]
    requests[0].num_computed_tokens += 5
    requests[0].output_token_ids.append(7)
    sched.add_request(requests[1])
    out = sched.schedule()
    # The running request decodes one token; the new prompt gets the remaining 15.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("0", 1),
        ("1", 15),
    ]


def test_admit_whole_admits_whole_prompts_in_order_until_one_is_refused():
    """``admit_whole`` (a pipelined step's arrivals): waiting requests start only with
    their whole prompt and only while the predicate accepts them; the first refusal (or
    a prompt the budget would chunk) stops admission, leaving the queue's order intact
    and nothing allocated for the refused."""
    pool = BlockPool(200)
    sched = Scheduler(SchedulerConfig(8, 24), KVCacheManager(pool, 4), 10_000)
    running = make_request(0, list(range(5)), 10)
    sched.add_request(running)
    sched.schedule()
    running.num_computed_tokens = 5
    running.output_token_ids.append(7)
    # Distinct prompts: no prefix-cache hits.
    ok, refused, after = (make_request(i, list(range(100 * i, 100 * i + 6)), 3) for i in (1, 2, 3))
    for r in (ok, refused, after):
        sched.add_request(r)
    out = sched.schedule(admit_whole=lambda r: r is not refused)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("0", 1),
        ("1", 6),
    ]
    assert list(sched.waiting) == [refused, after] and refused.block_ids == []
    for s in out.scheduled:  # both computed; each samples a token
        s.request.num_computed_tokens += s.num_new_tokens
        s.request.output_token_ids.append(7)
    sched.waiting.clear()
    long = make_request(4, list(range(400, 430)), 3)  # 30 tokens > the 22 left
    sched.add_request(long)
    out = sched.schedule(admit_whole=lambda r: True)
    assert [s.request.request_id for s in out.scheduled] == ["0", "1"]
    assert list(sched.waiting) == [long] and long.block_ids == []
    out = sched.schedule()  # without it the prompt is chunked to the budget
    assert ("4", 22) in [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_prefix_cache_hits_shared_system_prompt():
    system = list(range(1, 33))  # 8 full blocks of 4
    pool = BlockPool(100)
    kv = KVCacheManager(pool, 4)
    sched = Scheduler(SchedulerConfig(8, 1000), kv, 10_000)
    a = make_request(0, [*system, 900, 901], 1)
    sched.add_request(a)
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 34
    a.num_computed_tokens = 34
    b = make_request(1, [*system, 902], 1)
    sched.add_request(b)
    out = sched.schedule()
    new_b = next(s for s in out.scheduled if s.request is b)
    assert b.num_cached_tokens == 32 and new_b.num_new_tokens == 1
    assert b.block_ids[:8] == a.block_ids[:8]
    assert all(pool.blocks[i].ref_cnt == 2 for i in a.block_ids[:8])
    # Freed blocks stay cached: a third request still hits after both finish.
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    sched.finish(b, RequestStatus.FINISHED_STOPPED)
    c = make_request(2, [*system, 903, 904, 905], 1)
    assert len(kv.get_computed_blocks(c)) == 8


def test_full_prompt_hit_still_computes_last_token():
    pool = BlockPool(50)
    kv = KVCacheManager(pool, 4)
    sched = Scheduler(SchedulerConfig(8, 1000), kv, 10_000)
    a = make_request(0, list(range(8)), 1)
    sched.add_request(a)
    sched.schedule()
    a.num_computed_tokens = 8
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    b = make_request(1, list(range(8)), 1)
    sched.add_request(b)
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 4  # one block reused, the last one recomputed


def test_block_pool_ref_counts_and_eviction_order():
    pool = BlockPool(5)
    a = pool.allocate(4)
    assert NULL_BLOCK_ID not in a and pool.num_free_blocks == 0
    pool.free(list(reversed(a)))
    # Freed tail first: the next allocation evicts the tail block, keeping the prefix.
    assert pool.allocate(1) == [a[-1]]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[0]])
    with pytest.raises(RuntimeError):
        pool.allocate(10)


def test_allocation_failure_changes_nothing():
    pool = BlockPool(4)  # 3 usable
    kv = KVCacheManager(pool, 4)
    r = make_request(0, list(range(20)), 1)
    assert not kv.allocate_slots(r, 20)
    assert r.block_ids == [] and pool.num_free_blocks == 3
    assert kv.allocate_slots(r, 12)
    assert len(r.block_ids) == cdiv(12, 4)


def test_admit_batch_starts_waiting_requests_in_groups():
    """admit_batch=4: with the batch full, finished requests free slots one by one, but
    waiting ones start only once 4 can start together (a group the token budget splits
    keeps admitting in the next steps); outputs stay exact."""
    pool = BlockPool(400)
    sched = Scheduler(SchedulerConfig(8, 64, admit_batch=4), KVCacheManager(pool, 4), 10_000)
    specs = [(i, [i + 1] * 5, 3 + 2 * i) for i in range(8)]  # finish at different steps
    specs += [(i, [i + 1] * 20, 4) for i in range(8, 20)]  # 4 x 20 tokens > one budget
    requests = [make_request(*s) for s in specs]
    for r in requests:
        sched.add_request(r)
    admissions = []  # (free slots before the step, requests admitted)
    while sched.has_unfinished():
        running_before = {id(r) for r in sched.running}
        group_was_open = sched._group_open
        out = sched.schedule()
        admitted = sum(id(s.request) not in running_before for s in out.scheduled)
        free = sched.config.max_num_seqs - len(running_before)
        if admitted and not group_was_open and running_before:
            admissions.append((free, admitted))
            assert free >= 4  # a group opens only with 4 slots free
        for s in out.scheduled:
            r = s.request
            r.num_computed_tokens += s.num_new_tokens
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(fake_next_token(r.all_token_ids))
                if r.num_output_tokens >= r.max_tokens:
                    sched.finish(r, RequestStatus.FINISHED_LENGTH)
    for i, prompt, max_tokens in specs:
        assert requests[i].output_token_ids == reference_output(prompt, max_tokens)
    assert admissions and len(admissions) <= 3  # 12 waiting requests in groups, not 12 steps
    with pytest.raises(ValueError, match=r"admit_batch=9 must be in \[1, max_num_seqs=8\]"):
        SchedulerConfig(8, 64, admit_batch=9)


def test_update_keeps_what_verification_accepted_and_roll_back_checks_its_count() -> None:
    """``update`` advances plain rows by their scheduled tokens and verify rows by the root
    and accepted nodes only; ``advance`` and ``roll_back`` move one request; rolling back
    more than it computed names the request and the counts."""
    kv = KVCacheManager(BlockPool(64, False), 4)
    sched = Scheduler(SchedulerConfig(8, 64), kv, max_model_len=1000)
    a, b = make_request(0, [1, 2, 3], 9), make_request(1, [4, 5], 9)
    for r in (a, b):
        sched.add_request(r)
    out = sched.schedule()
    sched.update(out.scheduled)  # both prompts
    assert (a.num_computed_tokens, b.num_computed_tokens) == (3, 2)
    a.output_token_ids.append(7)
    b.output_token_ids.append(8)
    out = sched.schedule(num_lookahead_tokens=4)
    out.scheduled[0].num_new_tokens = 5  # a verifies a tree of 5 nodes: 1 accepted
    sched.update(out.scheduled, rejected={0: 3})
    assert (a.num_computed_tokens, b.num_computed_tokens) == (5, 3)
    sched.advance(a, 2)
    sched.roll_back(a, 3)
    assert a.num_computed_tokens == 4
    with pytest.raises(ValueError, match="request 1: cannot roll back 4 of its 3 computed"):
        sched.roll_back(b, 4)
