"""jaxpaged: LLM inference in JAX with PagedAttention and continuous batching.

    from jaxpaged import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct, embedded
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8))
"""

from jaxpaged.llm import LLM
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
