"""Torch-only pieces below both the attention backends and the Triton kernels: the
paged-cache contract (``AttentionMetadata``) and the PyTorch reference ops each kernel is
tested against, which the CPU path runs. Nothing here imports another specdec package."""
