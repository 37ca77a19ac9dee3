"""What the trainer optimises: a fresh (or given) EAGLE-3 head wrapped in ``TTTModel``.

The head is the serving module itself (``specdec.models.eagle3_head.Eagle3Head``) built
with a TTT attention backend. The target's embedding and lm_head are frozen tensors held
outside the module's parameters and buffers (so optimizers, DDP, DeepSpeed and checkpoints
never see them): the embedding feeds the head's inputs, lm_head turns the target's final
hidden states into labels.

Init (EAGLE-3's): the head's lm_head rows are the target's lm_head rows of the kept ids;
everything else is PyTorch's default init.

SpecExit (docs/spec_exit.md): a head built with ``exit_signals`` has exit channels, trained
by the ``SpecExitLoss`` term next to TTT, or alone (``freeze_draft``: every other
parameter frozen, TTT still computed, without gradients, for its figures).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from specdec.models import ModelConfig, load_config, resolve_model
from specdec.models.block_drafter import BlockDrafter
from specdec.models.eagle3_head import Eagle3Config, Eagle3Head
from specdec.models.head_variants import HEAD_VARIANTS
from specdec.models.weights import read_tensors
from specdec.train.spec_exit_loss import SpecExitLoss
from specdec.train.ttt import PackedBatch, TTTOutput, draft_rows, ttt_forward
from specdec.train.ttt_attention import TTTAttention, TTTFlexAttention

logger = logging.getLogger(__name__)

VOCAB_KEYS = ("lm_head.weight", "d2t", "t2d")  # a head's draft-vocabulary tensors


@dataclass
class TargetIO:
    """The target's frozen input embedding and output head."""

    config: ModelConfig
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding itself when tied)

    @classmethod
    def load(cls, target: str) -> TargetIO:
        """Read only these two tensors from the target's safetensors (a GGUF or alias is
        converted once into the specdec cache by ``resolve_model``)."""
        resolved = resolve_model(target)
        config = load_config(resolved)
        directory = Path(resolved.hf_dir)
        wanted = read_tensors(directory, ["model.embed_tokens.weight", "lm_head.weight"])
        embed = wanted["model.embed_tokens.weight"]
        if embed is None:
            raise ValueError(f"{directory} has no model.embed_tokens.weight")
        lm_head = wanted["lm_head.weight"]
        if lm_head is None:
            if not config.tie_word_embeddings:
                raise ValueError(f"{directory} has no lm_head.weight and does not tie it")
            lm_head = embed
        return cls(config, embed.float(), lm_head.float())

    def to(self, device: torch.device, dtype: torch.dtype) -> TargetIO:
        return TargetIO(self.config, self.embed.to(device, dtype), self.lm_head.to(device, dtype))


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from data_gen's ``vocab.safetensors`` (a file or its directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "vocab.safetensors"
    if not path.is_file():
        raise FileNotFoundError(
            f"no draft vocabulary at {path}; build it with `specdec data-gen vocab` and pass "
            "model.vocab=<that file>"
        )
    tensors = load_file(str(path))
    return tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)


def attention_backend(name: str, device: torch.device) -> TTTAttention:
    """``flex``: FlexAttention over the steps' key buffer (static shapes, compiled on GPU).
    ``auto``: flex on CUDA, the reference elsewhere. On the H200 the trainer's flex path
    trains the SmolLM2 head at 63-67k tok/s against the reference's 19-23k with the same
    losses (docs/benchmarks.md, "Training"); on CPU, compiling it costs more than it saves
    in a test-sized run."""
    if name == "flex" or (name == "auto" and device.type == "cuda"):
        return TTTFlexAttention(compile=device.type == "cuda")
    return TTTAttention()


def build_head(
    target: TargetIO,
    target_name: str,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    aux_layer_ids: tuple[int, ...],
    attention: TTTAttention,
    exit_signals: tuple[str, ...] = (),
    intermediate_size: int | None = None,
    num_layers: int = 1,
    variant: str = "eagle3",
) -> Eagle3Head:
    """A fresh head for ``target`` with the draft vocabulary (d2t, t2d), EAGLE-3's
    lm_head init, SpecExit channels for ``exit_signals`` (none by default), MLPs
    ``intermediate_size`` wide (default: the target's), ``num_layers`` layers, and the
    ``variant``'s switches (``HEAD_VARIANTS``)."""
    config = Eagle3Config.for_target(
        target.config,
        d2t.shape[0],
        aux_layer_ids=aux_layer_ids,
        target_name=target_name,
        exit_signals=exit_signals,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        **HEAD_VARIANTS[variant],
    )
    head = Eagle3Head(config, attention)
    head.set_vocab_map(d2t, t2d)
    kept = torch.arange(d2t.shape[0]) + d2t
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head[kept].to(head.lm_head.weight.dtype))
    return head


def carry_vocab_rows(
    head: Eagle3Head | BlockDrafter, rows: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor
) -> int:
    """Move a trained head's lm_head ``rows`` [old_draft_vocab, hidden], drafted under
    (``d2t``, ``t2d``), into ``head``, which drafts another vocabulary: each target token
    that both vocabularies keep takes its trained row; tokens new to ``head`` keep the rows
    they have (a fresh head's: the target's lm_head rows, ``build_head``). Returns how many
    rows were carried. A row belongs to its target token, not to its draft id, so rows
    move by token: no row is ever trained toward another token than the one it had."""
    old_kept = torch.arange(d2t.shape[0]) + d2t.cpu()  # [old_draft_vocab] target ids
    new_kept = torch.arange(head.d2t.shape[0]) + head.d2t.cpu()  # [draft_vocab] target ids
    old_index = torch.full((t2d.shape[0],), -1, dtype=torch.long)  # target id -> old draft id
    old_index[old_kept] = torch.arange(old_kept.shape[0])
    source = old_index[new_kept]  # [draft_vocab]: old draft id, or -1 for a new token
    shared = source >= 0
    with torch.no_grad():
        weight = head.lm_head.weight
        weight[shared.to(weight.device)] = rows[source[shared]].to(weight.device, weight.dtype)
    return int(shared.sum())


def widen_mlp(state: dict[str, torch.Tensor], head: Eagle3Head | BlockDrafter) -> int:
    """Rewrite a trained head's MLP weights in ``state`` (``intermediate_size`` I) for
    ``head``'s wider MLPs (I' > I), in place, so that the widened head computes exactly
    what the trained one did: in every layer the old units keep their gate, up and down
    weights; each new unit keeps ``head``'s fresh gate and up rows and gets a zero down
    column, so it adds nothing until training moves that column (its gradient is the
    unit's activation, nonzero), and then its gate and up rows train too. Layers already
    I' wide (new ones from ``deepen``) stay as they are. Returns I (the first layer's)."""
    fresh = head.state_dict()
    wide = head.config.intermediate_size
    widths = []
    for layer in head.decoder_layer_names:
        gate_up_key, down_key = f"{layer}.mlp.gate_up_proj.weight", f"{layer}.mlp.down_proj.weight"
        old_gate, old_up = state[gate_up_key].chunk(2, dim=0)  # [I, hidden] each
        old = old_gate.shape[0]
        widths.append(old)
        if wide < old:
            raise ValueError(
                f"model.intermediate_size={wide} is narrower than model.init_head's MLP "
                f"({old}); a trained head can be widened, not narrowed: drop the setting or "
                "raise it"
            )
        gate, up = fresh[gate_up_key].clone().chunk(2, dim=0)  # [I', hidden] each
        gate[:old], up[:old] = old_gate, old_up
        down = torch.zeros_like(fresh[down_key])  # [hidden, I']
        down[:, :old] = state[down_key]
        state[gate_up_key] = torch.cat([gate, up])
        state[down_key] = down
    return widths[0]


def deepen(
    state: dict[str, torch.Tensor], head: Eagle3Head | BlockDrafter, trained_layers: int
) -> None:
    """Add to a trained head's ``state`` (``trained_layers`` decoder layers) the layers
    ``head`` has beyond them, in place, so that the deeper head computes exactly what the
    trained one did: each new layer takes ``head``'s fresh weights with zero ``o_proj``
    and ``down_proj``, so both of its blocks add nothing to the residual stream it sits
    on. Those zero matrices get gradients (the blocks' inputs, nonzero), and once they
    move the rest of the layer trains too (the zero-output-column rule of ``widen_mlp``)."""
    if head.config.num_layers < trained_layers:
        raise ValueError(
            f"model.num_layers={head.config.num_layers} is fewer than model.init_head's "
            f"{trained_layers} layers; a trained head can be deepened, not cut: drop the "
            "setting or raise it"
        )
    fresh = head.state_dict()
    for layer in head.decoder_layer_names[trained_layers:]:
        for key, value in fresh.items():
            if key.startswith(f"{layer}."):
                silent = key.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
                state[key] = torch.zeros_like(value) if silent else value.clone()


def init_head_state(
    head: Eagle3Head | BlockDrafter, init: Eagle3Head | BlockDrafter
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """``init``'s weights (``model.init_head``) shaped for ``head``, the run's fresh model:
    deepened and widened where the run asks for more (``deepen``, ``widen_mlp``), and
    without its vocabulary tensors (``VOCAB_KEYS``) when ``head`` drafts another draft
    vocabulary (``model.vocab``). Returns the state and, in that last case, ``init``'s
    lm_head rows for ``carry_init_rows`` (else None)."""
    state = init.state_dict()
    same_vocab = init.d2t.shape == head.d2t.shape and torch.equal(init.d2t.cpu(), head.d2t.cpu())
    rows = None
    if not same_vocab:  # rows move by token, after the load
        rows = state["lm_head.weight"]
        for key in VOCAB_KEYS:
            state.pop(key)
    deep, shallow = head.config.num_layers, init.config.num_layers
    if deep != shallow:
        deepen(state, head, shallow)
        logger.info("model.init_head deepened from %d to %d layers (new ones start silent)",
                    shallow, deep)  # fmt: skip
    wide, old = head.config.intermediate_size, init.config.intermediate_size
    if wide != old:
        widen_mlp(state, head)
        logger.info("model.init_head's MLP widened from %d to %d units (new ones start silent)",
                    old, wide)  # fmt: skip
    return state, rows


def carry_init_rows(
    head: Eagle3Head | BlockDrafter, init: Eagle3Head | BlockDrafter, rows: torch.Tensor
) -> None:
    """After ``head`` loaded ``init_head_state``'s state: ``init``'s lm_head ``rows`` carried
    into ``head``'s vocabulary by target token (``carry_vocab_rows``), logged."""
    carried = carry_vocab_rows(head, rows, init.d2t, init.t2d)
    logger.info(
        "model.init_head drafts another vocabulary than model.vocab: %d of %d lm_head "
        "rows carried by target token, %d new tokens start from the target's lm_head",
        carried,
        head.d2t.shape[0],
        head.d2t.shape[0] - carried,
    )


class TTTModel(nn.Module):
    """``forward(batch) -> TTTOutput``: the whole unrolled objective in one module call,
    as DDP and DeepSpeed want (one forward per backward). With ``exit_loss`` the SpecExit
    term joins the loss on batches that carry ``exit_targets``; ``freeze_draft`` leaves
    only the exit channels trainable (module docstring); ``pad_to`` pads every batch to
    one size (``PackedBatch.padded``: the objective is unchanged) for attention backends
    that need static shapes."""

    def __init__(
        self,
        head: Eagle3Head,
        target: TargetIO,
        *,
        steps: int,
        decay: float,
        argmax_weight: float = 0.0,
        loss: str = "ce",
        lk_eta: float = 3.0,
        exit_loss: SpecExitLoss | None = None,
        freeze_draft: bool = False,
        pad_to: int | None = None,
    ) -> None:
        super().__init__()
        self.pad_to = pad_to  # every batch padded to this many tokens (static shapes)
        if (exit_loss is not None or freeze_draft) and head.spec_exit is None:
            raise ValueError("exit_loss/freeze_draft need a head with SpecExit channels")
        self.head = head
        self.steps, self.decay, self.argmax_weight = steps, decay, argmax_weight
        self.loss, self.lk_eta = loss, lk_eta
        self.exit_loss = exit_loss
        self.freeze_draft = freeze_draft
        if freeze_draft:
            for name, param in head.named_parameters():
                param.requires_grad_(name.startswith("spec_exit."))
        self.__dict__["target"] = target  # frozen, unregistered (module docstring)
        head.bind_embedding(self._embed)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.__dict__["target"].embed)

    def place_target(self, device: torch.device, dtype: torch.dtype) -> None:
        target = self.__dict__["target"].to(device, dtype)
        self.__dict__["target"] = target
        # The label rows are fixed for the run (the vocab map never changes in training).
        self.__dict__["label_weight"] = draft_rows(self.head, target.lm_head)

    def forward(self, batch: PackedBatch) -> TTTOutput:
        target: TargetIO = self.__dict__["target"]
        if self.pad_to is not None:
            batch = batch.padded(self.pad_to)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_draft):
            out = ttt_forward(
                self.head,
                batch,
                target.lm_head,
                steps=self.steps,
                decay=self.decay,
                label_weight=self.__dict__.get("label_weight"),
                argmax_weight=self.argmax_weight,
                loss=self.loss,
                lk_eta=self.lk_eta,
            )
        if self.exit_loss is not None and batch.exit_targets is not None:
            out.exit = self.exit_loss(self.head, batch)
            out.loss = out.loss + out.exit.loss
        return out
