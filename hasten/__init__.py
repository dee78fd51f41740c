"""hasten: a latency-first LLM serving stack."""

from hasten.outputs import CompletionOutput, RequestOutput
from hasten.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily so `import hasten` stays light (no torch)
        from hasten.engine.llm import LLM

        return LLM
    raise AttributeError(name)
