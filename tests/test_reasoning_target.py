"""The shipped reasoning target (alias ``smollm2-135m-reasoning``, a LoRA adapter in
``specdec/targets/``): it resolves as an adapter on SmolLM2, and it thinks and answers held-out
items in the trained format, checked by the tasks' own verifiers (real weights, fp32 CPU)."""

from __future__ import annotations

import json

import pytest
from reasoning_items import write_eval_items

from specdec.bench.reasoning import EvalConfig, run_eval
from specdec.models import ALIASES, resolve_model
from specdec.models.aliases import TARGETS_DIR, PackagedModel

ALIAS = "smollm2-135m-reasoning"
# The SpecExit setting measured with the shipped head (docs/spec_exit.md).
SHIPPED_SETTING = {"smoothing": "window", "window": 2}


def test_the_alias_resolves_to_the_shipped_adapter_on_smollm2(smollm2_dir):
    assert isinstance(ALIASES[ALIAS], PackagedModel)
    resolved = resolve_model(ALIAS)
    assert (resolved.name, resolved.source) == (ALIAS, "adapter")
    assert resolved.adapter == TARGETS_DIR / ALIAS
    assert resolved.hf_dir == smollm2_dir  # the base's converted GGUF, merged at load
    sft = json.loads((TARGETS_DIR / ALIAS / "specdec_sft.json").read_text())
    assert sft["base"] == "smollm2-135m-instruct" and sft["final_eval"]["eval/acc"] > 0.95


def test_a_missing_shipped_directory_names_the_reinstall(monkeypatch, tmp_path):
    monkeypatch.setattr("specdec.models.aliases.TARGETS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"missing from the installed specdec; reinstall"):
        resolve_model(ALIAS)


def test_the_shipped_target_thinks_and_answers_held_out_items(tmp_path, smollm2_tokenizer):
    """The first eval item of three tasks: each reply opens and closes its think span and
    its answer passes the verifier. These three are right in the 200-item eval of
    docs/reasoning_target.md; the base model writes no think span at all."""
    pytest.importorskip("reasoning_gym")
    tasks = ("chain_sum", "basic_arithmetic", "leg_counting")
    traces = write_eval_items(tmp_path / "eval.jsonl", smollm2_tokenizer, tasks, num_per_task=1)
    report = run_eval(
        EvalConfig(
            model=ALIAS,
            traces=str(traces),
            max_tokens=400,
            engine={"device": "cpu", "dtype": "float32", "max_model_len": 1024},
        )
    )
    ids = [item["id"] for item in report["items"]]
    assert ids == [
        "chain_sum/eval/1000000003",
        "basic_arithmetic/eval/1000000007",
        "leg_counting/eval/1000000007",
    ], "the eval split's first items changed (reasoning-gym or the splitter)"
    for item in report["items"]:
        assert item["opened"] and item["closed"], item
        assert item["correct"], item
        assert 0 < item["think_tokens"] < item["output_tokens"]


def test_the_shipped_head_records_its_measured_spec_exit_setting():
    """The reasoning alias's head records the SpecExit setting measured best for it
    (``spec_exit_defaults``), valid for its channels, so ``"spec_exit": true`` gets it."""
    from specdec.models import load_config
    from specdec.models.eagle3_formats import read_eagle3_config
    from specdec.models.packaged_heads import packaged_head

    config = read_eagle3_config(packaged_head(ALIAS), load_config(ALIAS))
    assert config.exit_signals == ("confidence", "progress", "remaining")
    assert config.spec_exit_defaults == SHIPPED_SETTING


def test_the_shipped_head_ends_thinking_early_and_keeps_the_answers(tmp_path, smollm2_tokenizer):
    """The reasoning alias ships an EAGLE-3 head with SpecExit channels (specdec/heads/,
    docs/spec_exit.md): it is the alias's default speculation, a chain of 3, and
    with SpecExit on in its recorded setting (``"spec_exit": {}``) it ends each held-out
    item's thinking early while every reply keeps EAGLE-3's answer (the exit lands once
    the answer is settled)."""
    pytest.importorskip("reasoning_gym")
    from specdec.models.packaged_heads import default_speculative

    spec = default_speculative(ALIAS)
    assert spec is not None and (spec.tree, spec.num_speculative_tokens) == ("chain", 3)
    traces = write_eval_items(tmp_path / "eval.jsonl", smollm2_tokenizer,
                              ("chain_sum", "leg_counting"), num_per_task=1)  # fmt: skip
    engine = {"device": "cpu", "dtype": "float32", "max_model_len": 1024, "speculative": spec}
    runs = {}
    for name, sampling in [("eagle3", {}), ("spec_exit", {"spec_exit": {}})]:
        config = EvalConfig(model=ALIAS, traces=str(traces), max_tokens=600, sampling=sampling,
                            engine=engine)  # fmt: skip
        runs[name] = run_eval(config)
    assert runs["spec_exit"]["spec_exit"]["exits"] == 2
    ran = runs["spec_exit"]["sampling"]["spec_exit"]
    assert {k: ran[k] for k in SHIPPED_SETTING} == SHIPPED_SETTING  # the head's record
    for base, cut in zip(runs["eagle3"]["items"], runs["spec_exit"]["items"], strict=True):
        assert cut["closed"] and cut["answer"] == base["answer"], (base, cut)
        assert cut["think_tokens"] < 0.8 * base["think_tokens"], (base, cut)
