"""Model loaders: GGUF files and Hugging Face directories, into one fused Llama weight layout."""

from gpu.loader.errors import ModelLoadError
from gpu.loader.load import LoadedModel, load_model

__all__ = ["LoadedModel", "ModelLoadError", "load_model"]
