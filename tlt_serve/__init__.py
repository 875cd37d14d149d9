"""tlt-serve: a speculative-decoding rollout server with online drafter adaptation."""

from tlt_serve.llm import LLM, GenerateResult
from tlt_serve.sampling_params import SamplingParams

__all__ = ["LLM", "GenerateResult", "SamplingParams"]
__version__ = "0.1.0"
