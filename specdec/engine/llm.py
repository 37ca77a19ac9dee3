"""``specdec.LLM``: offline batch generation on the engine (with a progress bar)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from specdec.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.outputs import RequestOutput
from specdec.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Load a target once, then generate for batches of prompts.

    >>> llm = LLM("smollm2-135m-instruct")
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_flat(model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs keep the
        prompts' order. All prompts are validated before any runs."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one, "
                    "or one per prompt"
                )
        # Offline batches only need each request's final output.
        params = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        return self._run(prompts, params, use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the tokenizer's chat template."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]  # type: ignore[list-item]
        prompts = [self.apply_chat_template(conv, add_generation_prompt) for conv in messages]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self, conversation: list[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"model {self.engine.config.model!r} has no chat template; use generate() "
                "with plain prompts"
            )
        ids = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer HF
            ids = ids["input_ids"]
        return list(ids)

    def _run(
        self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        # Tokenise and validate everything first: a bad prompt fails before any work.
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(engine.add_request(prompt, p))
        except Exception:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        order = {request_id: i for i, request_id in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        num_out = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        num_out += len(out.outputs[0].token_ids)
                        bar.update(1)
                        elapsed = bar.format_dict.get("elapsed") or 0
                        if elapsed:
                            bar.set_postfix(out_tok_s=f"{num_out / elapsed:.1f}")
        finally:
            bar.close()
        return [r for r in results if r is not None]
