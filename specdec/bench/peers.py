"""Peers: HF transformers ``generate`` on the same prompts, device and dtype, greedy, one
prompt at a time (HF's prompt lookup and assisted generation take batch 1 only).

- ``hf-generate``: plain greedy decoding;
- ``hf-prompt-lookup``: prompt lookup decoding (``prompt_lookup_num_tokens``);
- ``hf-assisted``: assisted generation with a draft model (HF's default schedule for the
  number of draft tokens).

The model's own generation config is replaced by one built here, so only what is written
here decides what ``generate`` does: EOS stops a request unless ``ignore_eos``, in which
case every request emits exactly ``max_tokens``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from specdec.bench.config import PeerConfig
from specdec.bench.driver import RequestRecord, Run, RunParams
from specdec.bench.env import synchronize
from specdec.models import resolve_model


@dataclass
class HFGenerate:
    """One peer: ``model.generate`` with fixed extra arguments."""

    model: Any  # transformers.PreTrainedModel
    extra: dict[str, Any]  # generate() keywords: prompt_lookup_num_tokens, assistant_model

    def __call__(self, prompts: list[list[int]], run: RunParams, eos: list[int]) -> Run:
        from transformers import GenerationConfig

        gen = GenerationConfig(
            do_sample=False,
            max_new_tokens=run.max_tokens,
            min_new_tokens=run.max_tokens if run.ignore_eos else 0,
            eos_token_id=None if run.ignore_eos else eos,
            pad_token_id=eos[0] if eos else 0,
            prompt_lookup_num_tokens=self.extra.get("prompt_lookup_num_tokens"),
        )
        assistant = self.extra.get("assistant_model")
        device = self.model.device
        records = []
        synchronize(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt], device=device)  # [1, prompt_len]
                kwargs = {"assistant_model": assistant} if assistant is not None else {}
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), generation_config=gen, **kwargs
                )
                new = out[0, ids.shape[1] :].tolist()
                records.append(RequestRecord(new, None, None, None, 0, 0, 0))
        synchronize(device)
        return Run(seconds=time.perf_counter() - t0, requests=records)


def _load(model: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    resolved = resolve_model(model)
    if resolved.adapter is not None:
        raise ValueError(
            f"the HF generate peer loads {model!r}'s base without its LoRA adapter; write a "
            "merged HF directory (specdec.models.hf_save.save_hf_model(load_model(...))) and "
            "bench that, or disable the peer"
        )
    hf_dir = resolved.hf_dir
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()


def build_peers(
    config: PeerConfig, model: str, device: torch.device, dtype: torch.dtype
) -> dict[str, HFGenerate]:
    """The enabled peers by name; the target is loaded once and shared."""
    if not config.enabled:
        return {}
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ImportError("HF peers need transformers: pip install 'transformers>=4.56'") from None
    target = _load(model, device, dtype)
    peers: dict[str, HFGenerate] = {}
    # Independent switches, not a dispatch: each enabled one adds a peer.
    if config.hf_generate:
        peers["hf-generate"] = HFGenerate(target, {})
    if config.hf_prompt_lookup is not None:
        extra = {"prompt_lookup_num_tokens": config.hf_prompt_lookup}
        peers["hf-prompt-lookup"] = HFGenerate(target, extra)
    if config.hf_assistant:
        extra = {"assistant_model": _load(config.hf_assistant, device, dtype)}
        peers["hf-assisted"] = HFGenerate(target, extra)
    return peers
