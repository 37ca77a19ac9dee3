"""Step hooks (specdec/step_hook.py) as the engine applies them: ``hook_cuts.cut_rows``
with scripted hooks and no model (which rows each hook sees, with which tokens and
signals, and what a cut leaves), a hook's request lifetime in ``OutputProcessor``, and a
toy hook that cuts and forces tokens in real runs (SmolLM2, a trained EAGLE-3 head, fp32,
CPU): the synchronous and the pipelined step apply its cuts alike, and the output after a
cut is plain decoding of the cut sequence, so the cut drafts' K/V was recomputed. SpecExit's
hook: tests/spec/test_spec_exit_engine.py and tests/spec/test_spec_pipeline.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from test_engine import DYNAMIC, greedy, make_llm, token_ids

from specdec.config import SpeculativeConfig
from specdec.engine.block_pool import BlockPool
from specdec.engine.hook_cuts import RowCut, cut_rows
from specdec.engine.kv_cache_manager import KVCacheManager
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.pipelined_step import PipelinedStep
from specdec.engine.scheduler import Scheduler
from specdec.outputs import RequestMetrics
from specdec.request import Request
from specdec.sampling_params import RequestOutputKind, SamplingParams
from specdec.step_hook import StepCut, VerifiedRow


class ScriptedHook:
    """Follows the request ids in ``follow``; cuts rows by ``verdicts[request_id]``;
    records what it was handed."""

    def __init__(self, follow: set[str], verdicts: dict[str, StepCut], refuse: bool = False):
        self.follow, self.verdicts, self.refuse = follow, verdicts, refuse
        self.seen: list[list[VerifiedRow]] = []
        self.admitted: set[str] = set()

    def admit(self, request: Request) -> None:
        if self.refuse:
            raise ValueError(f"request {request.request_id} refused")
        self.admitted.add(request.request_id)

    def follows(self, request: Request) -> bool:
        return request.request_id in self.follow

    def cut(self, rows: Sequence[VerifiedRow]) -> list[StepCut | None]:
        self.seen.append(list(rows))
        return [self.verdicts.get(r.request.request_id) for r in rows]

    def report(self, request: Request, metrics: RequestMetrics) -> None:
        metrics.spec_exits = 7

    def release(self, request_id: str) -> None:
        self.admitted.discard(request_id)


def _requests(*ids: str) -> list[Request]:
    return [Request(i, [1, 2], SamplingParams(max_tokens=8), (0,), 8) for i in ids]


def test_rows_no_hook_follows_read_nothing():
    reads: list[list[int]] = []
    hook = ScriptedHook(set(), {"a": StepCut(1)})
    cuts = cut_rows([hook], _requests("a"), [[5, 6]], [1], lambda js: reads.append(js) or [])
    assert cuts == {} and reads == [] and hook.seen == []


def test_hooks_judge_in_order_on_what_the_previous_left():
    """Signals are read once, for followed rows only; the second hook sees the first's cut
    (kept tokens, then forced ones); a row keeps the accepted drafts below every keep."""
    reads: list[list[int]] = []

    def read(js: list[int]) -> list[list[float] | None]:
        reads.append(js)
        return [[float(j)] for j in js]

    first = ScriptedHook({"a", "c"}, {"a": StepCut(2, (90, 91))})
    second = ScriptedHook({"a"}, {"a": StepCut(3, (92,))})
    requests = _requests("a", "b", "c")
    emitted = [[5, 6, 7, 8], [5, 6], [5, 6, 7]]
    cuts = cut_rows([first, second], requests, emitted, [3, 1, 2], read)
    assert reads == [[0, 2]]
    assert [(r.request.request_id, r.emitted, r.signals) for r in first.seen[0]] == [
        ("a", [5, 6, 7, 8], [0.0]),
        ("c", [5, 6, 7], [2.0]),
    ]
    assert [(r.emitted, r.signals) for r in second.seen[0]] == [([5, 6, 90, 91], [0.0])]
    assert cuts == {0: RowCut([5, 6, 90, 92], 2)}
    assert emitted[0] == [5, 6, 7, 8]  # the caller's lists are left as they were


def test_a_cut_at_the_bonus_keeps_every_accepted_draft():
    hook = ScriptedHook({"a"}, {"a": StepCut(3, (90,))})
    cuts = cut_rows([hook], _requests("a"), [[5, 6, 7]], [2], lambda js: [None] * len(js))
    assert cuts == {0: RowCut([5, 6, 7, 90], 2)}


def test_a_cut_past_the_emitted_tokens_is_refused():
    hook = ScriptedHook({"a"}, {"a": StepCut(3)})
    with pytest.raises(ValueError, match="ScriptedHook keeps 3 tokens of a step that emitted 2"):
        cut_rows([hook], _requests("a"), [[5, 6]], [1], lambda js: [None] * len(js))
    with pytest.raises(ValueError, match="keep=-1"):
        StepCut(-1)


def test_hooks_follow_a_request_from_add_to_forget(smollm2_tokenizer):
    """Admitted on add, reported into the metrics, released once forgotten; a request one
    hook refuses is released by the others and not kept."""
    from specdec.config import SchedulerConfig

    kv = KVCacheManager(BlockPool(64, enable_prefix_caching=False), 16)
    scheduler = Scheduler(SchedulerConfig(), kv, 64)
    hook = ScriptedHook(set(), {})
    hooks = [hook]
    processor = OutputProcessor(lambda: smollm2_tokenizer, scheduler, 64, hooks=hooks)
    params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
    request = Request("a", [1, 2], params, (0,), 1)
    scheduler.add_request(request)
    processor.add(request, None)
    assert hook.admitted == {"a"}
    state = processor.states["a"]
    processor.append_token(state, 5, None, 0.0)
    outputs: list = []
    processor.report(state, outputs)
    assert outputs[0].metrics.spec_exits == 7
    assert hook.admitted == set() and "a" not in processor.states
    hooks.append(ScriptedHook(set(), {}, refuse=True))  # the engine's list, shared
    with pytest.raises(ValueError, match="request b refused"):
        processor.add(Request("b", [1, 2], params, (0,), 1), None)
    assert hook.admitted == set() and "b" not in processor.states


class CutAt:
    """A toy hook: the verify step that emits output position ``at[prompt]`` keeps the
    tokens before it and forces ``forced`` after them (once per request; requests whose
    prompt is not in ``at`` are not followed). ``cuts[prompt]``: the cut step's accepted
    drafts and the tokens it kept."""

    def __init__(self, at: dict[tuple[int, ...], int], forced: tuple[int, ...]):
        self.at, self.forced = at, forced
        self.cuts: dict[tuple[int, ...], tuple[int, int]] = {}

    def admit(self, request: Request) -> None:
        pass

    def follows(self, request: Request) -> bool:
        key = tuple(request.prompt_token_ids)
        return key in self.at and key not in self.cuts

    def cut(self, rows: Sequence[VerifiedRow]) -> list[StepCut | None]:
        verdicts: list[StepCut | None] = []
        for row in rows:
            key, done = tuple(row.request.prompt_token_ids), row.request.num_output_tokens
            keep = self.at[key] - done
            if not 0 <= keep < len(row.emitted):  # the position is not in this step
                verdicts.append(None)
                continue
            self.cuts[key] = (len(row.emitted) - 1, keep)
            verdicts.append(StepCut(keep, self.forced))
        return verdicts

    def report(self, request: Request, metrics: RequestMetrics) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


def test_cuts_apply_alike_in_every_step_mode_and_recompute_kv(smollm2_dir, trained_head_dir, chats):
    """Three requests cut at output positions that land inside accepted drafts (the
    positions picked from where the head's steps fall: one keeps none of the step's
    tokens), a fourth not followed, in one batch. In the synchronous and the pipelined
    step alike, the hook sees the same steps and each output is plain greedy decoding
    before the position, the forced tokens, then plain greedy decoding of that sequence,
    as if the forced tokens had been sampled: the discarded drafts' K/V (computed by the
    cut step, now stale) was recomputed. The pipelined step drops the cut requests' rows
    in flight."""
    prompts = [chats[i] for i in (0, 3, 5, 9)]
    positions = (24, 19, 26)
    at = {tuple(prompt): p for prompt, p in zip(prompts, positions, strict=False)}
    forced = (1345, 30)
    n = 40
    plain = make_llm(smollm2_dir)
    expected = token_ids(plain.generate(prompts, greedy(n), use_tqdm=False))
    cut_prompts = []
    for prompt, tokens, p in zip(prompts, expected, positions, strict=False):
        assert tuple(tokens[p : p + len(forced)]) != forced  # greedy would not pick them
        cut_prompts.append(prompt + tokens[:p] + list(forced))
    rest = [greedy(n - p - len(forced)) for p in positions]
    continued = token_ids(plain.generate(cut_prompts, rest, use_tqdm=False))
    want = [
        [*tokens[:p], *forced, *more]
        for tokens, p, more in zip(expected, positions, continued, strict=False)
    ]
    outputs, cuts = {}, {}
    for pipelined in (False, True):
        spec = SpeculativeConfig(method="eagle3", model=str(trained_head_dir),
                                 pipelined=pipelined, **DYNAMIC)  # fmt: skip
        llm = make_llm(smollm2_dir, speculative=spec)
        engine = llm.engine
        hook = CutAt(at, forced)
        engine.step_hooks.append(hook)  # the output processor's list too
        outputs[pipelined] = token_ids(llm.generate(prompts, greedy(n), use_tqdm=False))
        cuts[pipelined] = hook.cuts
        assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_usable_blocks
        if pipelined:
            assert engine.pipeline.num_launches > 0 and engine.num_dropped_tokens > 0
            assert len(engine.proposer.rows) == 0 and not engine.mode(PipelinedStep).in_flight
    assert cuts[False] == cuts[True]
    assert set(cuts[False]) == set(at)
    assert all(keep < accepted for accepted, keep in cuts[False].values())
    assert min(keep for _, keep in cuts[False].values()) == 0
    assert outputs[False] == outputs[True]
    assert outputs[False][:3] == want
    assert outputs[False][3] == expected[3]
