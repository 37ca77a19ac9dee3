"""Triton kernels, each next to the PyTorch reference it is tested against.

Importing this package imports triton. Kernels compile for CUDA tensors; with
``TRITON_INTERPRET=1`` set before the import they run (slowly) in the interpreter on CPU.
"""

from specdec.kernels.decode import (
    DecodeConfig,
    default_decode_config,
    paged_decode,
    paged_decode_ref,
)
from specdec.kernels.launch import SplitPlan, plan_splits
from specdec.kernels.prefill import (
    PrefillConfig,
    choose_num_splits,
    default_prefill_config,
    paged_attention,
    paged_attention_ref,
)
from specdec.kernels.store_kv import (
    rope_store_kvcache,
    rope_store_kvcache_ref,
    store_kvcache,
    store_kvcache_ref,
)

__all__ = [
    "DecodeConfig",
    "PrefillConfig",
    "SplitPlan",
    "choose_num_splits",
    "default_decode_config",
    "default_prefill_config",
    "paged_attention",
    "paged_attention_ref",
    "paged_decode",
    "paged_decode_ref",
    "plan_splits",
    "rope_store_kvcache",
    "rope_store_kvcache_ref",
    "store_kvcache",
    "store_kvcache_ref",
]
