"""The EAGLE-3 head variants a training run names (train config ``model.variant``) and
their ``Eagle3Config`` switches (eagle3_head.py's module docstring). Torch-free, so that
configs validate the name without importing the head."""

from __future__ import annotations

HEAD_VARIANTS: dict[str, dict[str, bool]] = {
    "eagle3": {},
    # A norm on each fused aux state before fc, post-norm states fed back.
    "eagle3.1": {"fc_norm": True, "norm_output": True},
}
