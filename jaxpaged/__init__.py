"""jaxpaged: LLM inference in JAX with PagedAttention and continuous batching.

    from jaxpaged import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct, embedded
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8))
"""

from jaxpaged.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxpaged.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from jaxpaged.entrypoints.llm import LLM
from jaxpaged.lora import LoRARequest
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.sample.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "CompletionOutput", "EngineDeadError", "InvalidRequestError", "Logprob", "LoRARequest",
           "RequestFailedError", "RequestOutput", "RequestOutputKind", "SamplingParams",
           "StructuredOutputsParams"]
__version__ = "0.1.0"
