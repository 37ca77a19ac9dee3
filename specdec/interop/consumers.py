"""The engines that load EAGLE-3 heads, what each needs from a head directory, and how to
launch it: a registry that ``specdec export --to`` and ``specdec validate-head --for`` read.

What each reader does (sources named in ``specdec/models/eagle3_formats.py``; checked for
vLLM against the installed 0.32.0 ``v1/worker/gpu_model_runner.py``,
``models/llama_eagle3.py`` and ``transformers_utils/configs/speculators/``):

- **vLLM** reads the speculators format (and the research one). Aux ids: top-level
  ``eagle_aux_hidden_state_layer_ids`` first, else ``eagle_config``'s, either *as is* as the
  residual entering those layers. Needs ``norm_before_residual`` explicit in speculators
  configs (it defaults to true). Reads standard safetensors shards (not our row splits).
  Runs EAGLE-3.1 and speculators' variant from the top-level ``fc_norm``/``norm_output``/
  ``norm_before_fc`` flags (``llama_eagle3.py``, ``algos.py``).
- **SGLang** reads the research format only (``LlamaForCausalLMEagle3``); its loader maps
  ``midlayer.*``/``fc``/``norm``/``lm_head``/``d2t`` by name and silently *skips* any other
  key (a ``layers.0.*`` head would run with random weights). Aux ids only from
  ``eagle_config`` (output index; it adds 1); without them the defaults. A head config with
  ``tie_word_embeddings: true`` gets its lm_head replaced by the embedding; without
  ``draft_vocab_size`` it loads the target's lm_head.
- **EAGLE** (SafeAILab's ``EaModel``) reads one ``model.safetensors`` (or
  ``pytorch_model.bin``) in the research layout and hard-codes the aux layers
  (2, N//2, N-3), so a head trained on other layers cannot run there. It builds EAGLE-3
  proper: no variant norms, pre-norm feedback.
- **specdec** reads all three formats; the check is a real load against the target.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from specdec.interop.validate import FORMAT_NAMES, Check, Finding, HeadDir
from specdec.models.eagle3_formats import (
    EXIT_PREFIX,
    INDEX_FILE,
    SINGLE_FILE,
    Eagle3Format,
    load_eagle3,
)
from specdec.models.eagle3_head import default_aux_layer_ids
from specdec.models.weights import WeightLoadError


@dataclass(frozen=True)
class LaunchSpec:
    """What a launch line needs: the target (hub name or path), the exported head's
    directory and the chain length K."""

    target: str
    head_dir: str
    num_speculative_tokens: int


@dataclass(frozen=True)
class Consumer:
    """One engine that loads heads. ``writes`` is the format ``specdec export --to NAME``
    produces for it (None: not an export target), ``reads`` the formats it loads, ``checks``
    its own validation rules (run after the generic ones), ``launch`` its command line."""

    name: str
    title: str
    writes: Eagle3Format | None
    reads: tuple[Eagle3Format, ...]
    checks: tuple[Check, ...]
    launch: Callable[[LaunchSpec], str] | None = None


# ------------------------------------------------------------------ rules


def _reads_format(consumer: str, title: str, reads: tuple[Eagle3Format, ...]) -> Check:
    def check(head: HeadDir) -> list[Finding]:
        if head.format in reads:
            return []
        return [
            Finding(
                "error",
                "config.json",
                f"is in the {FORMAT_NAMES[head.format]} format; {title} reads "
                + " or ".join(FORMAT_NAMES[f] for f in reads),
                f"convert it: specdec export --to {consumer} {head.path} OUT_DIR",
            )
        ]

    return check


def _plain_shards(head: HeadDir) -> list[Finding]:
    """Row-split tensors (``key@i``, our 16 MB shards) are a specdec-only layout."""
    if not head.split:
        return []
    return [
        Finding(
            "error",
            f"weights: {INDEX_FILE}",
            f"splits {sorted(head.split)[:3]} into row parts, which only specdec joins",
            "export it (specdec export --to ...), which writes one model.safetensors",
        )
    ]


def _single_file(head: HeadDir) -> list[Finding]:
    """EAGLE opens exactly ``model.safetensors``."""
    if head.files == [SINGLE_FILE] and not (head.path / INDEX_FILE).exists():
        return []
    return [
        Finding(
            "error",
            "weights",
            f"are stored as {head.files}; EAGLE's loader opens only {SINGLE_FILE}",
            "export with specdec export --to eagle (one file)",
        )
    ]


def _vllm_ids(head: HeadDir) -> list[Finding]:
    """vLLM reads ``eagle_config`` ids in its own numbering when no top-level ids exist."""
    if head.top_ids is not None or head.nested_ids is None:
        return []
    shifted = [i + 1 for i in head.nested_ids]
    return [
        Finding(
            "error",
            "config.json: eagle_config.eagle_aux_hidden_state_layer_ids",
            f"{head.nested_ids} is SGLang numbering (output of layer i), but without "
            f"top-level ids vLLM reads it as entering layers {head.nested_ids}, one layer "
            f"below the trained {shifted}",
            f'add top-level "eagle_aux_hidden_state_layer_ids": {shifted}, or export with '
            "specdec export --to vllm",
        )
    ]


def _sglang_ids(head: HeadDir) -> list[Finding]:
    """SGLang takes aux ids from ``eagle_config`` only; otherwise the defaults."""
    if head.nested_ids is not None or head.top_ids is None:
        return []
    n = head.num_layers
    if n is not None and n >= 4 and list(head.top_ids) == list(default_aux_layer_ids(n)):
        return []  # SGLang's defaults are the same layers
    severity = "error" if n is not None else "warning"
    return [
        Finding(
            severity,
            "config.json: eagle_config",
            f"has no eagle_aux_hidden_state_layer_ids; SGLang ignores the top-level "
            f"{head.top_ids} and captures its default layers"
            + ("" if n is not None else " (without --target this cannot tell whether they differ)"),
            f'write "eagle_config": {{"eagle_aux_hidden_state_layer_ids": '
            f"{[i - 1 for i in head.top_ids]}}} (output index), or export with "
            "specdec export --to sglang",
        )
    ]


def _untied(head: HeadDir) -> list[Finding]:
    if not head.config.get("tie_word_embeddings"):
        return []
    return [
        Finding(
            "error",
            "config.json: tie_word_embeddings",
            "is true, so SGLang replaces the head's lm_head with the embedding",
            "set tie_word_embeddings to false (the head has its own lm_head)",
        )
    ]


def _has_draft_vocab(head: HeadDir) -> list[Finding]:
    if head.config.get("draft_vocab_size") is not None:
        return []
    return [
        Finding(
            "error",
            "config.json: draft_vocab_size",
            "is missing, so the research loaders size lm_head by the target's vocabulary "
            "(SGLang then loads the target's lm_head instead of the head's)",
            "write draft_vocab_size (lm_head.weight's first dimension)",
        )
    ]


def _eagle_default_ids(head: HeadDir) -> list[Finding]:
    """EAGLE hard-codes (2, N//2, N-3)."""
    if head.head is None or head.target is None:
        return []
    default = default_aux_layer_ids(head.target.num_layers)
    if tuple(head.head.aux_layer_ids) == default:
        return []
    return [
        Finding(
            "error",
            "config.json: aux layers",
            f"the head reads layers {list(head.head.aux_layer_ids)} (vLLM numbering) but "
            f"EAGLE's loader always feeds {list(default)}",
            "serve it with vLLM or SGLang (specdec export --to vllm|sglang)",
        )
    ]


def _one_layer(title: str) -> Check:
    """SGLang and EAGLE build exactly one decoder layer (eagle3_formats docstring)."""

    def check(head: HeadDir) -> list[Finding]:
        if head.head is None or head.head.num_layers == 1:
            return []
        return [
            Finding(
                "error",
                "config.json: num_hidden_layers",
                f"is {head.head.num_layers}; {title}'s EAGLE-3 drafter has exactly one layer",
                "serve it with vLLM (specdec export --to vllm) or specdec",
            )
        ]

    return check


def _eagle3_proper(error: bool, why: str) -> Check:
    """A variant head (EAGLE-3.1's ``fc_norm``/``norm_output``, ``norm_before_fc``) drafts
    another function where the reader builds EAGLE-3 proper."""

    def check(head: HeadDir) -> list[Finding]:
        if head.head is None or head.head.variant == "eagle3":
            return []
        return [
            Finding(
                "error" if error else "warning",
                "config.json",
                f"describes an {head.head.variant} head; {why}",
                "serve it with vLLM (specdec export --to vllm) or specdec",
            )
        ]

    return check


def _no_exit_channels(consumer: str, error: bool, why: str) -> Check:
    """SpecExit channels (``spec_exit.*``, specdec's own) are dropped by the export."""

    def check(head: HeadDir) -> list[Finding]:
        keys = sorted(k for k in head.tensors if k.startswith(EXIT_PREFIX))
        if not keys:
            return []
        return [
            Finding(
                "error" if error else "warning",
                "weights",
                f"store SpecExit channels {keys}; {why}",
                f"export it: specdec export --to {consumer} {head.path} OUT_DIR (drops them)",
            )
        ]

    return check


def _specdec_loads(head: HeadDir) -> list[Finding]:
    """The decisive check: specdec builds the head against the real target."""
    if head.target is None or head.head is None:
        return []
    try:
        load_eagle3(head.path, target_config=head.target)
    except (WeightLoadError, ValueError) as err:
        return [Finding("error", "load", str(err), "fix what the message names")]
    return []


# ------------------------------------------------------------------ launch lines


def _vllm_launch(s: LaunchSpec) -> str:
    spec = {
        "method": "eagle3",
        "model": s.head_dir,
        "num_speculative_tokens": s.num_speculative_tokens,
    }
    return (
        f"vllm serve {shlex.quote(s.target)} --speculative-config {shlex.quote(json.dumps(spec))}"
    )


def _sglang_launch(s: LaunchSpec) -> str:
    k = s.num_speculative_tokens
    return (
        f"python -m sglang.launch_server --model-path {shlex.quote(s.target)} "
        f"--speculative-algorithm EAGLE3 --speculative-draft-model-path "
        f"{shlex.quote(s.head_dir)} --speculative-num-steps {k} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {k + 1}"
    )


def _eagle_launch(s: LaunchSpec) -> str:
    return (
        "python -c 'from eagle.model.ea_model import EaModel; "
        f'm = EaModel.from_pretrained(base_model_path="{s.target}", '
        f'ea_model_path="{s.head_dir}", use_eagle3=True, total_token=-1)\''
    )


def _specdec_launch(s: LaunchSpec) -> str:
    return (
        f"specdec serve --model {shlex.quote(s.target)} --draft eagle3 --draft-model "
        f"{shlex.quote(s.head_dir)} --num-speculative-tokens {s.num_speculative_tokens}"
    )


CONSUMERS: dict[str, Consumer] = {
    c.name: c
    for c in (
        Consumer(
            "vllm",
            "vLLM",
            writes="speculators",
            reads=("speculators", "specdec", "eagle"),
            checks=(
                _reads_format("vllm", "vLLM", ("speculators", "specdec", "eagle")),
                _plain_shards,
                _vllm_ids,
                _no_exit_channels(
                    "vllm",
                    True,
                    "vLLM's weight loader refuses weights it has no parameter for",
                ),
            ),
            launch=_vllm_launch,
        ),
        Consumer(
            "sglang",
            "SGLang",
            writes="eagle",
            reads=("eagle", "specdec"),
            checks=(
                _reads_format("sglang", "SGLang", ("eagle", "specdec")),
                _one_layer("SGLang"),
                _eagle3_proper(
                    False,
                    "an SGLang without EAGLE-3.1 support skips fc_norm.* and ignores "
                    "norm_output, so check that its llama_eagle3.py reads them",
                ),
                _plain_shards,
                _sglang_ids,
                _untied,
                _has_draft_vocab,
                _no_exit_channels(
                    "sglang",
                    False,
                    "SGLang skips keys it does not know, so the head drafts without them",
                ),
            ),
            launch=_sglang_launch,
        ),
        Consumer(
            "eagle",
            "EAGLE",
            writes="eagle",
            reads=("eagle", "specdec"),
            checks=(
                _reads_format("eagle", "EAGLE", ("eagle", "specdec")),
                _one_layer("EAGLE"),
                _eagle3_proper(True, "EAGLE's head builds EAGLE-3 proper only"),
                _single_file,
                _eagle_default_ids,
                _has_draft_vocab,
                _no_exit_channels("eagle", True, "EAGLE's head has no such weights"),
            ),
            launch=_eagle_launch,
        ),
        Consumer(
            "specdec",
            "specdec",
            writes=None,
            reads=("specdec", "eagle", "speculators"),
            checks=(_specdec_loads,),
            launch=_specdec_launch,
        ),
    )
}
EXPORT_TARGETS = tuple(name for name, c in CONSUMERS.items() if c.writes is not None)


def get_consumer(name: str) -> Consumer:
    if name not in CONSUMERS:
        raise ValueError(f"unknown head consumer {name!r}; choose one of {sorted(CONSUMERS)}")
    return CONSUMERS[name]
