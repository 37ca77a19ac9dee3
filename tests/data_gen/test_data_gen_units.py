"""data_gen pieces without a model forward: the assistant loss mask in ChatML and Llama-3
templates, prompt sources and their bad-record counting, the prompt mix (deduplicated,
decontaminated, gsm_symbolic excluded), shard checksums and rank ownership, and the draft
vocabulary map."""

from __future__ import annotations

import copy
import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest

from specdec.data_gen import mix as mix_module
from specdec.data_gen.chat import tokenize_conversation
from specdec.data_gen.decontam import BenchmarkConfig, Decontaminator, load_benchmark_prompts
from specdec.data_gen.dump_plan import plan_groups, plan_shards
from specdec.data_gen.mix import MIX_SOURCES, MixConfig
from specdec.data_gen.prompts import PromptsConfig, run_prompts
from specdec.data_gen.records import SkipCounts
from specdec.data_gen.shards import RankInfo, ShardStore, load_manifest, verify_manifest
from specdec.data_gen.sources import read_source
from specdec.data_gen.vocab import build_vocab_map
from specdec.data_gen.writing import FORMS, writing_prompts

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] "
    "+ '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

SINGLE = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
MULTI = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue, like the sky."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "  Green \n"},
    {"role": "user", "content": "And the word assistant?"},
    {"role": "assistant", "content": "assistant\nuser: <- not a turn"},
]


@pytest.fixture(scope="module")
def llama3_tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer with Llama-3's special tokens and chat template."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
    tok.bos_token = "<|begin_of_text|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def _runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    prev = 0
    for t, m in zip(ids, mask, strict=True):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(t)
        prev = m
    return runs


@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single", "multi"])
@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_loss_mask_covers_exactly_the_assistant_tokens(
    messages, template, smollm2_tokenizer, llama3_tokenizer
):
    tok, eot, trim = (
        (smollm2_tokenizer, "<|im_end|>", False)
        if template == "chatml"
        else (llama3_tokenizer, "<|eot_id|>", True)
    )
    out = tokenize_conversation(tok, messages)
    # The ids are the template's rendering, tokenised as-is.
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(out.input_ids) == full
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    runs = _runs(out.input_ids, out.loss_mask)
    assert [tok.decode(r) for r in runs] == [(a.strip() if trim else a) + eot for a in answers]
    # Everything else (system, users, headers, the glue after end-of-turn) is unmasked.
    unmasked = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask, strict=True) if not m])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"].strip() in unmasked
    assert eot not in "".join(tok.decode(r)[: -len(eot)] for r in runs)


def test_loss_mask_fallback_for_tokenizers_that_change_pieces(smollm2_tokenizer):
    """A tokenizer that does not decode a piece back to itself (SentencePiece's leading
    space) is masked from one tokenisation by character overlap."""

    class PrefixSpace:
        def __init__(self, tok) -> None:
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __call__(self, *args, **kwargs):
            return self.tok(*args, **kwargs)

        def decode(self, ids):
            return " " + self.tok.decode(ids)

    exact = tokenize_conversation(smollm2_tokenizer, MULTI)
    fallback = tokenize_conversation(PrefixSpace(smollm2_tokenizer), MULTI)
    assert (
        fallback.input_ids
        == smollm2_tokenizer(
            smollm2_tokenizer.apply_chat_template(MULTI, tokenize=False), add_special_tokens=False
        )["input_ids"]
    )
    runs = _runs(fallback.input_ids, fallback.loss_mask)
    answers = [m["content"] for m in MULTI if m["role"] == "assistant"]
    assert len(runs) == 3
    for run, answer in zip(runs, answers, strict=True):
        assert smollm2_tokenizer.decode(run).lstrip("\n").endswith(answer + "<|im_end|>")
    assert sum(fallback.loss_mask) >= sum(exact.loss_mask)


def test_emitted_ids_stand_for_the_answers_they_wrote(smollm2_tokenizer):
    """A regenerated answer keeps the ids the model generated, even where they split the
    text differently from encoding it (here "Blue, like" written as "Bl" + "ue, like"); a
    length-cut answer (no end-of-turn id) gets the marker encoded after it; ids that do
    not write the answer are ignored. The rest of the record is unchanged."""
    tok = smollm2_tokenizer
    canonical = tokenize_conversation(tok, MULTI)
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    first = enc("Bl") + enc("ue, like the sky.") + [eot]  # generated, EOS included
    assert first[:-1] != enc("Blue, like the sky.")
    second = enc("  Green \n")  # cut by max_tokens: no end-of-turn id
    third = [*enc("something else"), eot]  # not this answer: encoded instead
    out = tokenize_conversation(tok, MULTI, [first, second, third])
    runs = _runs(out.input_ids, out.loss_mask)
    assert runs[0] == first
    assert runs[1] == [*second, eot]
    assert runs[2] == _runs(canonical.input_ids, canonical.loss_mask)[2]
    assert tok.decode(out.input_ids) == tok.decode(canonical.input_ids)
    assert len(out.input_ids) == len(canonical.input_ids) + 1  # "Bl" + "ue": one more
    with pytest.raises(ValueError, match=r"emitted holds 1 token lists for 3 assistant"):
        tokenize_conversation(tok, MULTI, [first])


def test_sources_parse_sharegpt_messages_and_prompts_and_count_bad_lines(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
        {"prompt": "plain", "id": "p1"},
        {"conversations": [{"from": "gpt", "value": "no user turn"}]},
        {"conversations": [{"from": "alien", "value": "?"}]},
        {"text": "no known field"},
        [1, 2],
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n{oops\n")
    skipped = SkipCounts()
    convs = list(read_source(str(path), skipped))
    assert [c.id for c in convs] == ["mixed.jsonl:1", "mixed.jsonl:2", "p1"]
    assert convs[0].messages[1] == {"role": "assistant", "content": "yo"}
    assert convs[1].messages[0]["role"] == "system"
    assert dict(skipped.counts) == {
        "empty": 2,  # the blank line and the record without a user turn
        "bad_message": 1,
        "bad_structure": 2,
        "bad_json": 1,
    }
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(read_source(str(tmp_path / "nope.jsonl"), skipped))


def test_hf_datasets_source_reads_a_local_file(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    convs = list(read_source(f"hf:{path}", SkipCounts()))
    assert [c.messages[0]["content"] for c in convs] == ["a", "b"]


def _bigbench_tarball(path: Path, tasks: dict[str, list[str]]) -> None:
    with tarfile.open(path, "w:gz") as t:
        for name, inputs in tasks.items():
            data = json.dumps({"examples": [{"input": x, "target": "y"} for x in inputs]}).encode()
            info = tarfile.TarInfo(f"bigbench-1.0.0/bigbench/benchmark_tasks/{name}/task.json")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def test_prompt_mix_is_deduplicated_decontaminated_and_resumable(tmp_path):
    """bigbench (a synthetic sdist), two reasoning-gym generators and chatterbot; a
    HumanEval prompt, a WritingBench query and a gsm_symbolic question planted among the
    bigbench inputs are dropped, as are duplicates."""
    bench = BenchmarkConfig(gsm_symbolic_size=50, writingbench_path=str(tmp_path / "wb.jsonl"))
    (tmp_path / "wb.jsonl").write_text(
        json.dumps({"query": "写一篇关于城市夜晚灯光与人们孤独感之间关系的散文，字数八百字左右。"})
        + "\n"
    )
    sets = load_benchmark_prompts(bench)
    assert len(sets["humaneval"]) == 164 and len(sets["gsm_symbolic"]) == 50
    humaneval = sets["humaneval"][7]
    gsm = "Please solve: " + sets["gsm_symbolic"][3]  # embedded, numbers and all
    writing = "请帮我：写一篇关于城市夜晚灯光与人们孤独感之间关系的散文，字数八百字左右。谢谢"
    clean = ["Translate 'cat' into French.", "Sort these words: pear, apple, fig."]
    _bigbench_tarball(
        tmp_path / "bb.tar.gz",
        {"a_task": [*clean, humaneval, "translate 'CAT'   into french."], "b_task": [gsm, writing]},
    )
    mix = MixConfig(
        bigbench_archive=str(tmp_path / "bb.tar.gz"),
        reasoning_gym_per_generator=3,
        reasoning_gym_generators=("basic_arithmetic", "word_sorting"),
    )
    config = PromptsConfig(
        output=str(tmp_path / "out"), mix=mix, benchmark=bench, records_per_shard=200
    )
    manifest = run_prompts(config, RankInfo())
    assert manifest["filtered"]["benchmark_overlap"] == 3
    assert manifest["filtered"]["duplicates"] >= 1  # the re-cased, re-spaced translation
    counts = manifest["counts"]
    assert counts["source_bigbench"] == 2 and counts["source_reasoning_gym"] == 6
    assert counts["source_chatterbot"] > 500  # English dialogs, repeated questions merged
    convs = list(read_source(str(tmp_path / "out"), SkipCounts()))
    assert not any(c.id.startswith("reasoning_gym/gsm_symbolic") for c in convs)
    texts = [c.prompt_text for c in convs]
    assert len(set(texts)) == len(texts)
    assert not any(humaneval in t or "孤独感" in t for t in texts)
    # Rerun: nothing to redo, identical bytes; a corrupt shard is redone.
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").glob("prompts-*")}
    shard = tmp_path / "out" / "prompts-00001.jsonl"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert verify_manifest(tmp_path / "out") == [shard.name]
    run_prompts(config, RankInfo())
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").glob("prompts-*")} == before


def test_writing_prompts_are_seeded_distinct_long_form_requests():
    prompts = writing_prompts(3000, seed=0)
    assert prompts == writing_prompts(3000, seed=0)
    assert prompts != writing_prompts(3000, seed=1)
    assert len(set(prompts)) == len(prompts)
    for text in prompts[:500]:
        form = next(f for f in FORMS if f.name + " " in text)
        words = int(re.search(r"(\d+) words", text).group(1))
        assert form.words[0] - 25 <= words <= form.words[1] + 25 and words % 50 == 0, text
    assert len({f.name for f in FORMS if any(f.name + " " in t for t in prompts)}) == len(FORMS)
    assert writing_prompts(0) == []
    with pytest.raises(ValueError, match=r"count=-1 must be in \[0, "):
        writing_prompts(-1)
    with pytest.raises(ValueError, match="writing_prompts=-3 must be >= 0"):
        MixConfig(writing_prompts=-3)


def test_the_writing_source_is_opt_in_and_decontaminated(tmp_path, monkeypatch):
    """``mix`` keeps the shipped head's three sources; ``writing`` adds composed requests
    (once, however often named), filtered against WritingBench like every source."""
    for name in MIX_SOURCES:  # the mix's own data is tested above; here it is empty
        monkeypatch.setitem(mix_module.BUILDERS, name, lambda config, skipped: iter(()))
    planted = writing_prompts(40, seed=0)[17]
    (tmp_path / "wb.jsonl").write_text(json.dumps({"query": planted}) + "\n")
    bench = BenchmarkConfig(gsm_symbolic_size=5, writingbench_path=str(tmp_path / "wb.jsonl"))
    config = PromptsConfig(
        output=str(tmp_path / "out"),
        sources=("mix", "writing", "writing"),
        mix=MixConfig(writing_prompts=40),
        benchmark=bench,
    )
    manifest = run_prompts(config, RankInfo())
    assert manifest["counts"]["source_writing"] == 39
    assert manifest["filtered"]["benchmark_overlap"] == 1
    convs = list(read_source(str(tmp_path / "out"), SkipCounts()))
    assert {c.source for c in convs} == {"writing"} and planted not in {
        c.prompt_text for c in convs
    }
    only_mix = PromptsConfig(
        output=str(tmp_path / "mix"), mix=MixConfig(writing_prompts=40), benchmark=bench
    )
    # The mix alone (emptied here) holds no writing requests.
    with pytest.raises(ValueError, match=r"no conversations left from sources \['mix'\]"):
        run_prompts(only_mix, RankInfo())


def test_mix_refuses_benchmark_generators():
    with pytest.raises(ValueError, match="gsm_symbolic is a benchmark set"):
        MixConfig(reasoning_gym_generators=("gsm_symbolic",))


def test_decontaminator_matches_templates_not_number_runs():
    dec = Decontaminator({"b": ["Sam has 3 apples and buys 4 more at the market on a sunny day."]})
    assert dec.overlaps("sam has 12 apples and buys 9 more at the market on a sunny day. Why?")
    assert not dec.overlaps("Sam has 3 apples.")
    grid = Decontaminator({"b": [" ".join(["0 1"] * 20)]})
    assert not grid.overlaps(" ".join(["1 0"] * 20) + " what is the largest island?")


def test_shard_store_checksums_ranks_and_merge(tmp_path):
    store = ShardStore(tmp_path, "x", "bin")
    digests = ["d0", "d1", "d2", "d3", "d4"]
    ranks = [RankInfo(r, 2) for r in range(2)]
    assert [list(r.owned(5)) for r in ranks] == [[0, 2, 4], [1, 3]]
    for i in ranks[1].owned(5):
        store.write(i, f"shard {i}".encode(), digests[i], {"records": i})
    with pytest.raises(RuntimeError, match="3 of 5 shards"):
        store.merge(digests, {})
    for i in store.pending(digests, ranks[0].owned(5)):
        store.write(i, f"shard {i}".encode(), digests[i], {"records": i})
    manifest = store.merge(digests, {"stage": "x"})
    assert manifest["counts"] == {"records": 10} and manifest["num_shards"] == 5
    assert load_manifest(tmp_path)["shards"][2]["file"] == "x-00002.bin"
    # Corrupt bytes, a stale input digest, and a missing file all make a shard pending.
    store.path(0).write_bytes(b"shard X")
    store.path(1).unlink()
    assert store.pending(digests, range(5)) == [0, 1]
    assert store.pending(["d0", "d1", "new", "d3", "d4"], [2, 3]) == [2]
    with pytest.raises(ValueError, match="0 <= RANK < WORLD_SIZE"):
        RankInfo(2, 2)


def test_dump_plan_bounds_shards_and_groups():
    lengths = [10, 10, 10, 50, 10]
    shards = plan_shards(lengths, bytes_per_token=1, shard_bytes=25)
    assert [(s.start, s.end) for s in shards] == [(0, 2), (2, 3), (3, 4), (4, 5)]  # 50 alone
    groups = plan_groups(shards, batch_tokens=40)
    assert [[s.index for s in g.shards] for g in groups] == [[0, 1], [2], [3]]  # 50 alone


def test_vocab_map_round_trip_ascending_and_padded():
    counts = np.zeros(100, dtype=np.int64)
    counts[[7, 3, 42, 99, 15]] = [5, 9, 9, 1, 2]
    d2t, t2d = build_vocab_map(counts, 4)
    kept = np.arange(4) + d2t
    assert kept.tolist() == [3, 7, 15, 42]  # the four most frequent, ascending
    assert t2d[kept].all() and t2d.sum() == 4 and d2t.dtype == np.int64
    d2t, t2d = build_vocab_map(counts, 8)  # more than appear: padded with the lowest unused
    kept = np.arange(8) + d2t
    assert kept.tolist() == [0, 1, 2, 3, 7, 15, 42, 99]
    assert all(t2d[i + d2t[i]] for i in range(8)) and np.all(np.diff(kept) > 0)
    with pytest.raises(ValueError, match="exceeds the target vocabulary"):
        build_vocab_map(counts, 101)


def test_coverage_by_size_counts_the_most_frequent_tokens():
    from specdec.data_gen.vocab import coverage_by_size

    counts = np.zeros(5000, dtype=np.int64)
    counts[:1024] = 3  # 3,072 of 4,096 loss tokens in the 1,024 most frequent ids
    counts[1024:2048] = 1
    assert coverage_by_size(counts) == {"1024": 0.75, "2048": 1.0, "4096": 1.0}
    assert coverage_by_size(np.zeros(10, dtype=np.int64)) == {}
