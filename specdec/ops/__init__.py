"""Torch-only pieces below both the attention backends and the Triton kernels: the
paged-cache contract (``AttentionMetadata``), a step's inputs as the runner executes them
(``StepInputs``), and the PyTorch reference ops each kernel is tested against, which the
CPU path runs. Nothing here imports another specdec package."""
