"""Give an HF config directory random weights (seeded), for speed measurements.

Decode speed does not depend on weight values, so a model with SmolLM2-135M's exact
config and random weights times the same as the real one; this lets a GPU machine without
network build the model from a 4 MB config + tokenizer folder instead of the 98 MB GGUF.
Usage: python benchmarks/random_weights.py CONFIG_DIR OUT_DIR [--dtype bf16]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("config_dir")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    config = AutoConfig.from_pretrained(a.config_dir)
    model = AutoModelForCausalLM.from_config(config)  # HF init: normal(0, 0.02)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    out = Path(a.out_dir)
    model.to(dtype).save_pretrained(out)
    for f in Path(a.config_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja",):
            shutil.copy(f, out / f.name)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)")


if __name__ == "__main__":
    main()
