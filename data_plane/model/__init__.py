"""A Llama-family decoder (Llama, Mistral, Qwen2) that loads Hugging Face directories."""

from data_plane.model.config import ModelConfig
from data_plane.model.llama import LlamaForCausalLM
from data_plane.model.loader import load_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "load_model"]
