"""The error a checkpoint that cannot be loaded raises: a module of its own, so code that
only needs to name it (or to find the bundled model) does not import torch."""


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message is meant for the person who named it."""
