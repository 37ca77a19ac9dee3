"""Errors of model loading, in a leaf module (no torch): torch-free readers of checkpoint
configs raise them too."""


class WeightLoadError(ValueError):
    """The checkpoint does not match the model built from its config.json."""
