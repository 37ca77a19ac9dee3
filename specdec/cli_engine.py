"""The engine and speculation flags shared by every command that runs the engine
(generate, bench, serve, data-gen regenerate and exit-labels, eval-reasoning), and their
translation into ``LLM`` keyword arguments. Torch-free: the parser loads in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import re

DEFAULT_MODEL = "smollm2-135m-instruct"


def add_engine_args(
    p: argparse.ArgumentParser, draft: str = "none", draft_fallback: str | None = None
) -> None:
    """The engine and speculation flags. ``draft``: ``--draft``'s default; ``draft_fallback``:
    what ``--draft auto`` uses for a model that ships no head (None: plain decoding), as
    ``engine_kwargs`` is told. Defaults are written into the help text as literals (not
    ``%(default)s``): ``specdec serve`` resets every default to None to tell given flags
    from its config file's values, and its help must still show the engine's defaults."""
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="the target: an alias (smollm2-135m-instruct, smollm2-135m-reasoning), an HF "
        f"model directory, a .gguf file or a hub name (default: {DEFAULT_MODEL})",
    )
    g.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda or cuda:N (default: auto: cuda when a GPU is present, else cpu)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        help="float32, bfloat16 or float16 (default: auto: bfloat16 on a GPU, float32 on the CPU)",
    )
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton", "triton_invariant"],
        help="attention kernels: triton (paged FlashAttention-style), triton_invariant (one "
        "batch-invariant kernel, what --deterministic takes) or torch (the reference) "
        "(default: auto: triton on a GPU, torch on the CPU, triton_invariant with "
        "--deterministic)",
    )
    g.add_argument(
        "--enforce-eager", action="store_true", help="run every step eagerly: no CUDA graphs"
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant target: a token's logits have the same bits whatever the step "
        "computing it, so speculative output equals plain output token for token in bf16 "
        "too; Triton GEMMs and norms at every row count, the triton_invariant attention "
        "backend, the target's layers uncompiled; slower (default: off)",
    )
    g.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)"
    )
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not share the KV blocks of common prompt prefixes between requests",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        metavar="BYTES",
        help="KV cache size in bytes (default: on a GPU, what --gpu-memory-utilization "
        "leaves after the weights and profiled activations; on the CPU, 1 GiB)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the GPU's memory the engine may use, KV cache included (default: 0.9)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="most requests running at once (default: 256)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens computed per step (default: 8192; data-gen regenerate: 32768)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length in tokens, prompt and output together (default: the model's)",
    )
    g.add_argument(
        "--admit-batch",
        type=int,
        default=None,
        help="start waiting requests in groups of this many so most steps replay CUDA "
        "graphs (default: 1, at once; data-gen regenerate: max-num-seqs / 4)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the engine's sampling RNG, for requests without their own (default: 0)",
    )
    g.add_argument(
        "--triton-gemm-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="on CUDA, projections of at most N token rows (decode, verify and draft steps) "
        "run the skinny Triton GEMM instead of cuBLAS (experimental: slower than cuBLAS in "
        "the engine on the H200) (default: 0: cuBLAS always)",
    )
    g.add_argument(
        "--prefill-graph-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="on CUDA, steps with prompt tokens of at most N tokens replay a CUDA graph per "
        "(tokens, sequences) bucket instead of launching eagerly (default: 8192, capped by "
        "--max-num-batched-tokens; 0: eager)",
    )
    g.add_argument(
        "--defer-graphs",
        type=on_off,
        default=None,
        metavar="on|off",
        help="on CUDA, capture the graphs the first requests do not need after start-up, "
        "between steps: speculation's (steps decode plainly until they are ready) and those "
        "of steps over 64 sequences (eager until then) (default: on for serve, off "
        "otherwise)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap host work with the device by keeping one step in flight (default: "
        "on for plain decoding with CUDA graphs, off otherwise)",
    )
    auto = f"else {draft_fallback}" if draft_fallback else "else plain decoding"
    g.add_argument(
        "--draft",
        default=draft,
        choices=["auto", "none", "ngram", "eagle3", "draft_model", "dflash"],
        help="speculate with this proposer: auto: the model's shipped EAGLE-3 head "
        f"(specdec/heads), {auto}; ngram: prompt lookup; eagle3: an EAGLE-3 head; "
        "draft_model: a smaller LM; dflash: a block drafter (chains); none: plain "
        f"decoding (default: {draft})",
    )
    g.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="with --draft eagle3: the head directory (default: the model's shipped head); "
        "with --draft draft_model: the draft LM (alias, HF directory or .gguf; required); "
        "with --draft dflash: the block drafter directory (ours or vLLM's dflash; required)",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="chain length K, or the depth of a dynamic tree (default: the head's; a block "
        "drafter's block size - 1; else 3)",
    )
    g.add_argument(
        "--num-speculative-tokens-by-batch-size",
        type=depth_bands,
        default=None,
        metavar="B:K,...",
        help="draft to depth K while at most B requests run, e.g. 4:5 (larger batches: "
        "--num-speculative-tokens), or another shape: 1:t8-d6-n32 (a dynamic tree), 4:c5 "
        "(a chain), @cuda after a shape for CUDA only; none: one shape for all (default: "
        "the head's bands, else none)",
    )
    g.add_argument(
        "--spec-tree",
        default=None,
        choices=["chain", "dynamic", "static"],
        help="draft shape: a chain, EAGLE-2's dynamic tree, or --spec-choices (default: the "
        "head's, else chain)",
    )
    g.add_argument(
        "--spec-top-k",
        type=int,
        default=None,
        help="dynamic tree: children per node (default: the head's, else 8)",
    )
    g.add_argument(
        "--spec-total-tokens",
        type=int,
        default=None,
        help="dynamic tree: draft nodes kept (default: the head's, else 48)",
    )
    g.add_argument(
        "--spec-disable-by-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="decode plainly while more than N requests run (default: the head's, else never)",
    )
    g.add_argument(
        "--spec-pipelined",
        type=on_off,
        default=None,
        metavar="on|off",
        help="launch each speculative step before reading the last one (greedy EAGLE-3; "
        "default: on with CUDA graphs, else off)",
    )
    g.add_argument(
        "--spec-compile-head",
        type=on_off,
        default=None,
        metavar="on|off",
        help="torch.compile the EAGLE-3 head inside its CUDA graphs (default: on)",
    )
    g.add_argument(
        "--spec-compile-growth",
        type=on_off,
        default=None,
        metavar="on|off",
        help="with --spec-compile-head: compile the whole draft side of a captured step "
        "(index arithmetic, catch-up, every level, tree building) as one region, not only "
        "the head's layer and logits (default: on)",
    )
    g.add_argument(
        "--spec-choices",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='static tree (--spec-tree static) as JSON choice paths, e.g. "[[0], [1], [0, '
        "0]]\" (default: the head's, if it records a static tree)",
    )


# --spec-* flags -> SpeculativeConfig fields (the tree shape and when to speculate)
TREE_FLAGS = {
    "num_speculative_tokens": "num_speculative_tokens",
    "num_speculative_tokens_by_batch_size": "num_speculative_tokens_by_batch_size",
    "spec_tree": "tree",
    "spec_top_k": "top_k",
    "spec_total_tokens": "total_tokens",
    "spec_choices": "choices",
    "spec_disable_by_batch_size": "disable_by_batch_size",
    "spec_pipelined": "pipelined",
    "spec_compile_head": "compile_head",
    "spec_compile_growth": "compile_growth",
}


_TREE_BAND = re.compile(r"t(\d+)-d(\d+)-n(\d+)")


def depth_bands(value: str) -> list[list]:
    """``B:K,B:K`` -> ``[[B, K], ...]``; ``B:tT-dD-nN`` -> ``[B, {dynamic tree}]``, ``B:cK``
    -> ``[B, {chain of K}]`` (``none``: [], no bands)."""
    if value.strip().lower() == "none":
        return []
    bands: list[list] = []
    try:
        for pair in value.split(","):
            batch, shape = pair.split(":")
            shape, at, device = shape.partition("@")
            tree = _TREE_BAND.fullmatch(shape)
            if tree:
                t, d, n = (int(g) for g in tree.groups())
                band = {"tree": "dynamic", "top_k": t, "num_speculative_tokens": d,
                        "total_tokens": n}  # fmt: skip
            elif shape.startswith("c"):
                band = {"tree": "chain", "num_speculative_tokens": int(shape[1:])}
            else:
                band = int(shape)
            if at:
                if not isinstance(band, dict) or not device:
                    raise ValueError(f"{pair}: @DEVICE follows a shape (t..-d..-n.. or cK)")
                band["device"] = device
            bands.append([int(batch), band])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: use MAX_BATCH:K pairs, e.g. 4:5 or 2:6,8:4, a shape per band "
            "(1:t8-d6-n32 a dynamic tree, 4:c5 a chain; 1:t8-d6-n32@cuda on CUDA only), "
            "or none"
        ) from None
    return bands


def on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{value!r}: use on or off")
    return value == "on"


def speculative_config(args: argparse.Namespace, fallback: str | None = None):
    """``--draft``/``--draft-model``/``--spec-*`` -> ``SpeculativeConfig`` or None (plain).

    ``auto`` drafts with the model's shipped head (``specdec.models.packaged_heads``),
    else with ``fallback`` (None: plain decoding); ``eagle3`` without ``--draft-model``
    uses the shipped head. Tree flags given override the head's recorded tree (the
    shipped head's, or ``--draft-model``'s own), which overrides ``SpeculativeConfig``'s
    defaults."""
    from specdec.config import SpeculativeConfig
    from specdec.models.block_drafter_file import read_block_size
    from specdec.models.packaged_heads import default_speculative, head_speculative

    method = args.draft
    if method in (None, "none"):
        return None
    given = {flag: getattr(args, flag) for flag in TREE_FLAGS}
    tree = {TREE_FLAGS[flag]: value for flag, value in given.items() if value is not None}
    if method == "auto":
        if args.draft_model is not None:
            raise ValueError(
                f"--draft-model {args.draft_model} needs --draft eagle3, draft_model or dflash"
            )
        spec = default_speculative(args.model, **tree)
        if spec is not None or fallback is None:
            return spec
        method = fallback
    if method == "eagle3" and args.draft_model is None:
        spec = default_speculative(args.model, **tree)
        if spec is None:
            raise ValueError(
                f"--draft eagle3 needs --draft-model HEAD_DIR: {args.model!r} ships no head"
            )
        return spec
    if method == "eagle3":
        return head_speculative(args.draft_model, **tree)
    if method == "dflash":
        if args.draft_model is None:
            raise ValueError("--draft dflash needs --draft-model DRAFTER_DIR (a block drafter)")
        # One block drafts block_size - 1 tokens: the chain it was trained to fill.
        tree.setdefault("num_speculative_tokens", read_block_size(args.draft_model) - 1)
    return SpeculativeConfig(method=method, model=args.draft_model, **tree)


def engine_kwargs(args: argparse.Namespace, draft_fallback: str | None = None) -> dict:
    """``LLM`` keyword arguments from the engine flags; ``draft_fallback``: the proposer
    of ``--draft auto`` when the model ships no head (None: plain decoding)."""
    return dict(
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        deterministic=args.deterministic,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        **_given(
            max_num_batched_tokens=args.max_num_batched_tokens,
            admit_batch=args.admit_batch,
            triton_gemm_max_tokens=args.triton_gemm_max_tokens,
            prefill_graph_max_tokens=args.prefill_graph_max_tokens,
        ),
        seed=args.seed,
        speculative=speculative_config(args, draft_fallback),
        async_scheduling=args.async_scheduling,
        defer_graphs=args.defer_graphs,
    )


def _given(**kwargs) -> dict:
    """The flags the user set: unset ones (None) keep the config's (or a command's) default."""
    return {k: v for k, v in kwargs.items() if v is not None}


def positive_int(value: str) -> int:
    """An integer >= 1 (argparse ``type``), refused with the values a flag accepts."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: use an integer >= 1")
    return n
