"""The one exception every model loader raises: a message meant for the person who picked the model."""


class ModelLoadError(Exception):
    """A model path, file or its contents cannot be used. The message says what, where, and what to do."""
