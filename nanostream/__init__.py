"""nanostream: stream tokens from a local LLM into async Python code.

from nanostream import LLM, SamplingParams
llm = LLM("/models/Qwen3-0.6B")
print(llm.generate("Hello", SamplingParams(max_tokens=32))[0].text)
"""

from nanostream.config import EngineConfig
from nanostream.errors import InvalidRequestError, ModelLoadError, NanostreamError
from nanostream.llm import LLM
from nanostream.outputs import RequestOutput
from nanostream.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "EngineConfig",
    "InvalidRequestError",
    "ModelLoadError",
    "NanostreamError",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
