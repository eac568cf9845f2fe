"""Model definitions (Flax NNX), their Hugging Face checkpoint loaders and the registry.

Imports `pallas_kernels` for attention and nothing of the engine or the server.
"""

from jaxpaged.models.base import (DenseBatch, ModelConfig, ModelInput, dense_forward, forward,
                                  pooled_hidden_states)
from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.registry import (MODEL_REGISTRY, SUPPORTED_ARCHITECTURES, load_config,
                                      load_model)

__all__ = ["MODEL_REGISTRY", "SUPPORTED_ARCHITECTURES", "DenseBatch", "LlamaConfig",
           "LlamaForCausalLM", "ModelConfig", "ModelInput", "dense_forward", "forward",
           "pooled_hidden_states",
           "load_config", "load_model"]
