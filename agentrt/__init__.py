"""agentrt: a serving runtime for agents and structured output."""

from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.request import SamplingParams

__all__ = ["LLM", "ConstraintSpec", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":  # the SDK loads torch and the model stack only when used
        from agentrt.sdk import LLM

        return LLM
    raise AttributeError(name)
