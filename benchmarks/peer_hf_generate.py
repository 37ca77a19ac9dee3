"""Peer benchmark: HF transformers ``generate`` (greedy) on the same model and device.

Method. Prompts are random token ids from a fixed seed, all of one length, so the batch
needs no padding: the attention mask is all ones and left/right padding makes no
difference. ``generate`` runs greedy (``do_sample=False``) with
``min_new_tokens == max_new_tokens`` and no EOS token, so it never stops early. For each
attention implementation and batch size we time

- ``t_1``: generate with 1 new token  (prefill + one sampling step + call overhead),
- ``t_N``: generate with N new tokens,

each the median of ``--repeats`` runs after ``--warmup`` untimed runs. Then

- decode tokens/s  = batch * (N - 1) / (t_N - t_1)   (prefill subtracted),
- ms/step          = (t_N - t_1) / (N - 1) * 1000,
- prefill tokens/s = batch * prompt_len / t_1.

The model's own generation config (sampling defaults, EOS) is replaced by a bare one so
that only the arguments written here decide what ``generate`` does.

    python benchmarks/peer_hf_generate.py --model-dir HF_DIR --batch-sizes 1,64 --json out/hf.json
    python benchmarks/peer_hf_generate.py --smoke --random-tiny                 # CPU check

``HF_DIR`` as in ``peer_gpt_fast.py``. Prints a table last: ms/step, decode and prefill
tokens/s per (attention implementation, batch).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

if __package__:  # python -m benchmarks.peer_hf_generate
    from . import common
else:  # python benchmarks/peer_hf_generate.py
    import common

BENCH = "hf-generate"


def load_hf_model(
    model_dir: str | Path, device: torch.device, dtype: torch.dtype, attn_implementation: str
):  # -> transformers.PreTrainedModel
    """Load for greedy generation that never stops at EOS (bare generation config)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attn_implementation
    )
    model = model.to(device).eval()
    pad = model.config.pad_token_id
    # eos_token_id=None: generate() fills unset options from this config, so EOS must be
    # absent here, not merely omitted from the call.
    model.generation_config = GenerationConfig(
        pad_token_id=pad if pad is not None else 0, eos_token_id=None, bos_token_id=None
    )
    return model


def hf_greedy_tokens(
    model,  # transformers.PreTrainedModel from load_hf_model
    prompt_ids: torch.Tensor,  # [B, T] int64
    new_tokens: int,
) -> torch.Tensor:  # [B, new_tokens] int64 on cpu
    """Greedy continuation by ``generate``; always exactly ``new_tokens`` tokens."""
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=torch.ones_like(prompt_ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
    )
    new = out[:, prompt_ids.shape[1] :]
    if new.shape[1] != new_tokens:
        raise RuntimeError(f"generate returned {new.shape[1]} new tokens, wanted {new_tokens}")
    return new.cpu()


@dataclass(frozen=True)
class Options:
    model_dir: str | None
    random_tiny: bool = False
    device: str | None = None
    dtype: str | None = None
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    prompt_len: int = 128
    new_tokens: int = 256  # N; the decode figure covers N - 1 tokens
    repeats: int = 3
    warmup: int = 1
    attn_implementations: tuple[str, ...] = ("eager", "sdpa")
    seed: int = 0
    json_path: str | None = None
    smoke: bool = False

    def __post_init__(self) -> None:
        if (self.model_dir is None) == (not self.random_tiny):
            raise ValueError("give exactly one of --model-dir DIR or --random-tiny")
        if self.new_tokens < 2:
            raise ValueError(f"--new-tokens must be >= 2 to time decode, got {self.new_tokens}")
        if min(self.prompt_len, self.repeats) <= 0:
            raise ValueError("prompt_len and repeats must be positive")


def run_one(model, opts: Options, impl: str, batch: int, device: torch.device) -> common.ResultRow:
    prompt = common.random_prompt_ids(
        batch, opts.prompt_len, model.config.vocab_size, opts.seed, device
    )
    n = opts.new_tokens
    t_1 = common.measure(
        lambda: hf_greedy_tokens(model, prompt, 1),
        device,
        warmup=opts.warmup,
        repeats=opts.repeats,
    )
    t_n = common.measure(
        lambda: hf_greedy_tokens(model, prompt, n),
        device,
        warmup=opts.warmup,
        repeats=opts.repeats,
    )
    decode_s = t_n - t_1
    row = common.ResultRow(
        bench=BENCH,
        variant=f"attn={impl}",
        batch_size=batch,
        prompt_len=opts.prompt_len,
        new_tokens=n,
        prefill_tokens_per_s=batch * opts.prompt_len / t_1,
    )
    if decode_s > 0:
        row.ms_per_step = decode_s / (n - 1) * 1e3
        row.decode_tokens_per_s = batch * (n - 1) / decode_s
    else:  # timing noise swamped the decode time; a figure would be meaningless
        row.note = f"t_N={t_n:.4f}s <= t_1={t_1:.4f}s; raise --new-tokens"
    return row


def run(opts: Options) -> list[common.ResultRow]:
    device = common.resolve_device(opts.device)
    dtype = common.resolve_dtype(opts.dtype, device)
    env = common.env_info(device, dtype)
    common.print_env(env)
    rows: list[common.ResultRow] = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        model_dir = (
            common.make_random_tiny_model_dir(tmp) if opts.random_tiny else Path(opts.model_dir)
        )
        for impl in opts.attn_implementations:
            model = load_hf_model(model_dir, device, dtype, impl)
            for batch in opts.batch_sizes:
                print(f"  attn={impl} batch {batch} ...", flush=True)
                row = run_one(model, opts, impl, batch, device)
                rows.append(row)
                print(
                    f"  attn={impl} batch {batch}: {row.ms_per_step or float('nan'):.3f} ms/step",
                    flush=True,
                )
                if opts.json_path:
                    common.write_json(opts.json_path, env=env, options=opts, rows=rows)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print()
    print(common.markdown_table(rows))
    return rows


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="HF-format dir: config.json + *.safetensors")
    p.add_argument("--random-tiny", action="store_true", help="tiny random Llama, no weights")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(common.DTYPES), help="default: bf16 cuda, fp32 cpu")
    p.add_argument("--batch-sizes", default="1,8,64", type=common.parse_int_list)
    p.add_argument("--prompt-len", type=int, default=128, help="random ids, fixed seed")
    p.add_argument("--new-tokens", type=int, default=256, help="N new tokens per sequence")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats; medians reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    p.add_argument(
        "--attn-implementations",
        default="eager,sdpa",
        type=common.parse_str_list,
        help="HF attn_implementation values, measured in order (eager is the peer figure)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="write env, options and rows here")
    p.add_argument("--smoke", action="store_true", help="cpu fp32, batch 1,2, 8 tokens, 1 repeat")
    ns = p.parse_args(argv)
    opts = Options(
        model_dir=ns.model_dir,
        random_tiny=ns.random_tiny,
        device=ns.device,
        dtype=ns.dtype,
        batch_sizes=tuple(ns.batch_sizes),
        prompt_len=ns.prompt_len,
        new_tokens=ns.new_tokens,
        repeats=ns.repeats,
        warmup=ns.warmup,
        attn_implementations=tuple(ns.attn_implementations),
        seed=ns.seed,
        json_path=ns.json_path,
        smoke=ns.smoke,
    )
    if opts.smoke:
        opts = replace(
            opts,
            device="cpu",
            dtype="fp32",
            batch_sizes=(1, 2),
            prompt_len=32,
            new_tokens=8,
            repeats=1,
            warmup=1,  # the first generate call pays one-time setup; keep it out of t_1
        )
    return opts


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
