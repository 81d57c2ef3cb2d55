"""nanostream: stream tokens from a local LLM into async Python code.

from nanostream import LLM, SamplingParams
llm = LLM("/models/Qwen3-0.6B")
print(llm.generate("Hello", SamplingParams(max_tokens=32))[0].text)
"""

from nanostream.client import AsyncClient, Completion, Stream, StreamChunk
from nanostream.config import EngineConfig, ServerConfig
from nanostream.errors import (
    ClientClosedError,
    EngineDeadError,
    InvalidRequestError,
    ModelLoadError,
    NanostreamError,
    ProtocolError,
)
from nanostream.llm import LLM
from nanostream.outputs import RequestOutput
from nanostream.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncClient",
    "ClientClosedError",
    "Completion",
    "EngineConfig",
    "EngineDeadError",
    "InvalidRequestError",
    "ModelLoadError",
    "NanostreamError",
    "ProtocolError",
    "RequestOutput",
    "SamplingParams",
    "ServerConfig",
    "Stream",
    "StreamChunk",
]
__version__ = "0.1.0"
