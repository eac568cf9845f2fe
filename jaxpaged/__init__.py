"""jaxpaged: LLM inference in JAX with PagedAttention and continuous batching.

    from jaxpaged import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct, embedded
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8))

The public names are imported on first use (PEP 562 `__getattr__`), so that importing a
submodule (`jaxpaged.config`, `jaxpaged.engine.arg_utils`) does not load the engine and its
worker.
"""

import importlib

# The C++ kernels learn where to build as soon as jaxpaged is imported (`jaxpaged.platforms`
# configures them), so code that calls `cpu_attention.available()` directly finds them.
import jaxpaged.platforms  # noqa: F401,E402

# Public name -> the module that defines it.
_EXPORTS = {
    "LLM": "jaxpaged.entrypoints.llm",
    "BeamSearchOutput": "jaxpaged.entrypoints.beam_search",
    "BeamSearchParams": "jaxpaged.entrypoints.beam_search",
    "BeamSearchSequence": "jaxpaged.entrypoints.beam_search",
    "EngineDeadError": "jaxpaged.errors",
    "InvalidRequestError": "jaxpaged.errors",
    "RequestFailedError": "jaxpaged.errors",
    "LoRARequest": "jaxpaged.lora",
    "CompletionOutput": "jaxpaged.outputs",
    "Logprob": "jaxpaged.outputs",
    "RequestOutput": "jaxpaged.outputs",
    "RequestOutputKind": "jaxpaged.sampling_params",
    "SamplingParams": "jaxpaged.sampling_params",
    "StructuredOutputsParams": "jaxpaged.sample.structured_outputs",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxpaged' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
