"""The one exception every model loader raises, with a message meant for people."""


class ModelLoadError(Exception):
    """A model path, file or its contents cannot be used.

    The message says what was wrong, in which file, and what to do about it.
    """
