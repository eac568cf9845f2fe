"""Model definitions (Flax NNX) and their Hugging Face checkpoint loaders.

Imports `pallas_kernels` for attention and nothing of the engine or the server.
"""

from jaxpaged.models.config import SUPPORTED_ARCHITECTURES, LlamaConfig
from jaxpaged.models.llama import LlamaForCausalLM, ModelInput, forward
from jaxpaged.models.loader import load_llama

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaConfig", "LlamaForCausalLM", "ModelInput", "forward",
           "load_llama"]
