"""nano-vllm: a small, readable, fast LLM inference engine.

`LLM` is imported lazily so the pure-Python parts (sampling params, scheduler, block manager)
can be used and tested without importing torch.
"""
from typing import TYPE_CHECKING

from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from nanovllm.llm import LLM
    from nanovllm.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from nanovllm.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from nanovllm import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
