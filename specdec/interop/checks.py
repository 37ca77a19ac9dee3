"""The checks every head gets, whatever engine loads it (``validate.GENERIC_CHECKS``
runs them in order): config fields, the speculators structure, aux-id conventions, that
the config parses into a head for the target, keys and shapes, dtypes, the vocab map.

Each takes the ``HeadDir`` and returns its ``Finding``s; ``check_parses`` also fills
``HeadDir.head``, which the later checks need (they return nothing without it).
"""

from __future__ import annotations

import torch

from specdec.interop.validate import (
    FORMAT_NAMES,
    IDS_KEY,
    IGNORED_KEYS,
    Check,
    Finding,
    HeadDir,
    read_small_tensor,
    stand_in_target,
)
from specdec.models.eagle3_formats import (
    checkpoint_shapes,
    read_eagle3_config,
    to_speculators_key,
)
from specdec.models.eagle3_head import default_aux_layer_ids, validate_vocab_map
from specdec.models.weights import WeightLoadError

_REQUIRED_LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def check_layer_fields(head: HeadDir) -> list[Finding]:
    """The HF Llama fields every reader builds the layer from, all missing ones at once
    (their values are ``check_parses``'s: the loader's own rules)."""
    where = "config.json" + (": transformer_layer_config" if not head.research_format else "")
    layer = head.layer
    out = [
        Finding("error", where, f"missing {name}", f"add {name} (the target's value)")
        for name in _REQUIRED_LAYER_FIELDS
        if name not in layer
    ]
    if head.config.get("draft_vocab_size") is None:
        out.append(
            Finding(
                "warning",
                "config.json: draft_vocab_size",
                "is missing, so readers assume the full target vocabulary (SGLang then "
                "loads the target's lm_head instead of the head's)",
                "write draft_vocab_size (lm_head.weight's first dimension)",
            )
        )
    return out


def check_speculators_fields(head: HeadDir) -> list[Finding]:
    """What vLLM's speculators reader requires (``SpeculatorsConfig.validate_...``)."""
    if head.research_format:
        return []
    out: list[Finding] = []
    spec = head.config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or []
    if not methods or "speculative_tokens" not in methods[0]:
        out.append(
            Finding(
                "error",
                "config.json: speculators_config.proposal_methods",
                "has no first method with speculative_tokens; vLLM rejects the config",
                'write [{"proposal_type": "greedy", "speculative_tokens": K}]',
            )
        )
    if "name_or_path" not in (spec.get("verifier") or {}):
        out.append(
            Finding(
                "error",
                "config.json: speculators_config.verifier",
                "has no name_or_path; vLLM rejects the config",
                "write the target model's hub name or path (specdec export --verifier)",
            )
        )
    if not isinstance(head.config.get("transformer_layer_config"), dict):
        out.append(
            Finding(
                "error",
                "config.json: transformer_layer_config",
                "is missing; vLLM builds the decoder layer from it",
                "write the layer's HF Llama config there",
            )
        )
    if "norm_before_residual" not in head.config:
        out.append(
            Finding(
                "error",
                "config.json: norm_before_residual",
                "is missing: vLLM then assumes true, the speculators library false, so the "
                "head computes a different function in each",
                'write "norm_before_residual": false for heads trained as EAGLE-3 proper '
                "(EAGLE, SpecForge and specdec heads), true only if training used it",
            )
        )
    return out


def check_aux_ids(head: HeadDir) -> list[Finding]:
    """Both numberings agree, lie in the target's layers, and do not look like the other
    convention written into the wrong field (the usual off-by-one)."""
    out: list[Finding] = []
    top, nested, n = head.top_ids, head.nested_ids, head.num_layers
    if nested is not None and not head.research_format:
        out.append(
            Finding(
                "warning",
                "config.json: eagle_config",
                "a speculators config's eagle_config is ignored by vLLM when top-level ids "
                "exist and read in vLLM numbering otherwise",
                f"keep the ids only at top level ({IDS_KEY}, vLLM numbering)",
            )
        )
    for name, ids, low in (("top-level", top, 0), ("eagle_config", nested, -1)):
        if ids is None:
            continue
        bad_type = [i for i in ids if not isinstance(i, int)]
        high = n if name == "top-level" else (n - 1 if n else None)
        outside = [i for i in ids if isinstance(i, int) and (i < low or (high and i >= high))]
        if len(ids) != 3 or bad_type or outside:
            out.append(
                Finding(
                    "error",
                    f"config.json: {name} {IDS_KEY}",
                    f"{ids} must be three layer ids in [{low}, {high if high else 'N'})"
                    + (f" for the {n}-layer target" if n else ""),
                    "write the target's aux layers (default: "
                    + (
                        f"{list(default_aux_layer_ids(n))} top-level, "
                        f"{[i - 1 for i in default_aux_layer_ids(n)]} in eagle_config)"
                        if n and n >= 4
                        else "(2, N//2, N-3) top-level, one less in eagle_config)"
                    ),
                )
            )
    if top is not None and nested is not None and [i + 1 for i in nested] != list(top):
        out.append(
            Finding(
                "error",
                f"config.json: {IDS_KEY}",
                f"top-level {top} (vLLM numbering: entering layer i) and eagle_config's "
                f"{nested} (SGLang numbering: output of layer i, so entering i + 1) name "
                "different layers",
                f"make eagle_config's ids the top-level ones minus 1 ({[i - 1 for i in top]}) "
                "or drop the wrong list",
            )
        )
    if n and n >= 4:
        entering = list(default_aux_layer_ids(n))
        output = [i - 1 for i in entering]
        if top is not None and list(top) == output and nested is None:
            out.append(
                Finding(
                    "warning",
                    f"config.json: top-level {IDS_KEY}",
                    f"{top} equals the default layers in SGLang numbering; vLLM reads this "
                    f"field as the residual entering layers {top}, one layer below "
                    f"{entering}",
                    f"if the head was trained on the defaults, write {entering} here",
                )
            )
        if nested is not None and list(nested) == entering and top is None:
            out.append(
                Finding(
                    "warning",
                    f"config.json: eagle_config.{IDS_KEY}",
                    f"{nested} equals the default layers in vLLM numbering; SGLang adds 1 "
                    f"and captures {[i + 1 for i in nested]}",
                    f"if the head was trained on the defaults, write {output} here",
                )
            )
    return out


def check_parses(head: HeadDir) -> list[Finding]:
    """The config describes a head specdec can build (and, with a target, fits it): the
    loader's rules (one layer, SiLU, no biases, supported variants, sizes), first failure."""
    if any(name not in head.layer for name in _REQUIRED_LAYER_FIELDS):
        return []  # check_layer_fields named them
    ids = head.top_ids or ([i + 1 for i in head.nested_ids] if head.nested_ids else None)
    try:
        target = head.target or stand_in_target(head.layer, ids)
        head.head = read_eagle3_config(head.path, target)
    except (WeightLoadError, ValueError, KeyError, TypeError) as err:
        return [
            Finding(
                "error",
                "config.json",
                f"does not describe a head for this target: {err}",
                "correct the field it names, or pass the target the head was trained for",
            )
        ]
    return []


def check_tensors(head: HeadDir) -> list[Finding]:
    """Every key the config implies is stored with its shape, nothing else is, and the
    stored layout is the format's (``midlayer.*`` vs ``layers.0.*``)."""
    if head.head is None or not head.stored_keys:
        return []
    out: list[Finding] = []
    own, other = ("midlayer.", "layers.0.") if head.research_format else ("layers.0.", "midlayer.")
    foreign = [k for k in head.stored_keys if k.startswith(other)]
    if foreign:
        out.append(
            Finding(
                "error",
                "weights",
                f"{len(foreign)} keys use the {other}* layout of the other format "
                f"(e.g. {foreign[0]}) in a {FORMAT_NAMES[head.format]}-format head; readers "
                "skip or reject them",
                f"rename them to {own}* or re-export with `specdec export`",
            )
        )
    expected = checkpoint_shapes(head.head)
    has_map = "d2t" in head.tensors or "t2d" in head.tensors
    full_vocab = head.head.draft_vocab_size == head.head.vocab_size
    for key, shape in expected.items():
        if key in ("d2t", "t2d") and full_vocab and not has_map:
            continue  # the full vocabulary: the identity map is implied
        info = head.tensors.get(key)
        stored = to_speculators_key(key) if not head.research_format else key
        if info is None:
            out.append(
                Finding(
                    "error",
                    f"weights: {stored}",
                    "is missing",
                    "export the complete head (the checkpoint is truncated or not EAGLE-3)",
                )
            )
        elif info.shape != shape:
            out.append(
                Finding(
                    "error",
                    f"weights: {stored}",
                    f"has shape {list(info.shape)}; config.json implies {list(shape)}",
                    "the config and the weights belong to different heads; pair them up",
                )
            )
    unexpected = sorted(set(head.tensors) - set(expected) - IGNORED_KEYS)
    if unexpected:
        out.append(
            Finding(
                "error",
                "weights",
                f"{len(unexpected)} keys config.json does not describe: "
                f"{', '.join(unexpected[:5])}",
                "remove them, or use the reader of the EAGLE variant that wrote them",
            )
        )
    return out


def check_dtypes(head: HeadDir) -> list[Finding]:
    """Weights floating and of one dtype; ``d2t`` int64 offsets, ``t2d`` bool."""
    out: list[Finding] = []
    weights = {k: v for k, v in head.tensors.items() if k not in ("d2t", "t2d")}
    non_float = sorted(k for k, v in weights.items() if not v.dtype.is_floating_point)
    if non_float:
        out.append(
            Finding(
                "error",
                "weights",
                f"{', '.join(non_float[:5])} are not floating point "
                f"({weights[non_float[0]].dtype}); quantized heads are not supported",
                "export the head in float32, bfloat16 or float16",
            )
        )
    dtypes = sorted({str(v.dtype) for v in weights.values() if v.dtype.is_floating_point})
    if len(dtypes) > 1:
        out.append(
            Finding(
                "warning",
                "weights",
                f"mix dtypes {dtypes}; engines cast everything to one dtype",
                "cast all weights to one dtype before exporting",
            )
        )
    for key, want in (("d2t", torch.int64), ("t2d", torch.bool)):
        info = head.tensors.get(key)
        if info is not None and info.dtype != want:
            bad = info.dtype.is_floating_point
            out.append(
                Finding(
                    "error" if bad else "warning",
                    f"weights: {key}",
                    f"is {info.dtype}; the convention is {want}"
                    + (" (a float map cannot hold exact ids)" if bad else ""),
                    f"store {key} as {want}",
                )
            )
    return out


def check_vocab_map(head: HeadDir) -> list[Finding]:
    """``d2t``/``t2d`` come together and form one sorted set of kept target ids."""
    has = {key: key in head.tensors for key in ("d2t", "t2d")}
    if not any(has.values()):
        return []
    if not all(has.values()):
        present = "d2t" if has["d2t"] else "t2d"
        return [
            Finding(
                "error",
                "weights",
                f"stores {present} without its partner",
                "store both d2t (int64 offsets) and t2d (bool mask), built from one list",
            )
        ]
    d2t, t2d = read_small_tensor(head, "d2t"), read_small_tensor(head, "t2d")
    if d2t is None or t2d is None or d2t.is_floating_point() or t2d.is_floating_point():
        return []  # reported by check_dtypes
    try:
        validate_vocab_map(d2t.to(torch.int64), t2d.to(torch.bool))
    except ValueError as err:
        return [Finding("error", "weights: d2t/t2d", str(err), "rebuild the vocab map")]
    return []


GENERIC_CHECKS: tuple[Check, ...] = (
    check_layer_fields,
    check_speculators_fields,
    check_aux_ids,
    check_parses,
    check_tensors,
    check_dtypes,
    check_vocab_map,
)
