"""Model definitions and loaders."""

from kvserve.models.catalog import default_model_path, resolve_model_path
from kvserve.models.config import ModelConfig, RopeScaling
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import LoadedModel, load_model

__all__ = [
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "RopeScaling",
    "default_model_path",
    "load_model",
    "resolve_model_path",
]
