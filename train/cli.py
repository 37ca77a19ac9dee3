"""``specdec train-draft``: train an EAGLE-3 head; ``specdec train-sft``: fine-tune a target
on chat records (the reasoning target's recipe). Registered in ``specdec.cli.COMMANDS``.

    specdec train-draft --config configs/train/smollm2.yaml data.path=out/dump optim.lr=3e-4
    accelerate launch --config_file configs/accelerate/zero2.yaml -m specdec.cli \\
        train-draft --config configs/train/smollm2.yaml
    specdec train-sft --config configs/train/smollm2_reasoning_sft.yaml
"""

from __future__ import annotations

import argparse
import json

from specdec.cli import command


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML run config (configs/train/*.yaml); default: built-ins")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. optim.lr=3e-4 data.path=out/dump")  # fmt: skip
    p.add_argument("--print-config", action="store_true", help="print the resolved config, exit")


@command("train-draft", _args)
def cmd_train_draft(args: argparse.Namespace) -> int:
    """Train an EAGLE-3 draft head (training-time test) on data_gen dumps or online."""
    from specdec.train.config import TrainConfig

    config = TrainConfig.load(args.config, args.overrides)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    from specdec.train.trainer import train

    result = train(config)
    print(json.dumps(result, indent=2))
    return 0


@command("train-sft", _args)
def cmd_train_sft(args: argparse.Namespace) -> int:
    """Fine-tune a target model on chat records (assistant-token loss, packed)."""
    from specdec.train.sft_config import SFTConfig

    config = SFTConfig.load(args.config, args.overrides)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    from specdec.train.sft import train_sft

    result = train_sft(config)
    print(json.dumps(result, indent=2))
    return 0
