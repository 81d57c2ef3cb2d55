"""nanostream: stream tokens from a local LLM into async Python code.

    from nanostream import LLM, SamplingParams
    llm = LLM("/models/Qwen3-0.6B")
    print(llm.generate("Hello", SamplingParams(max_tokens=32))[0].text)

``LLM`` (which needs torch) is imported on first use, so client processes that only stream from an
engine start quickly.
"""

from typing import TYPE_CHECKING, Any

from nanostream.client import AsyncClient, Completion, Stream, StreamChunk
from nanostream.config import EngineConfig, ServerConfig
from nanostream.errors import (
    ClientClosedError,
    ConnectionLostError,
    EngineBusyError,
    EngineDeadError,
    InvalidRequestError,
    ModelLoadError,
    NanostreamError,
    ProtocolError,
    RequestFailedError,
    RequestTimeoutError,
)
from nanostream.outputs import CompletionOutput, RequestOutput
from nanostream.sampling_params import SamplingParams
from nanostream.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from nanostream.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from nanostream.llm import LLM

        return LLM
    raise AttributeError(f"module 'nanostream' has no attribute {name!r}")


__all__ = [
    "LLM",
    "AsyncClient",
    "ClientClosedError",
    "Completion",
    "CompletionOutput",
    "ConnectionLostError",
    "EngineBusyError",
    "EngineConfig",
    "EngineDeadError",
    "InvalidRequestError",
    "ModelLoadError",
    "NanostreamError",
    "ProtocolError",
    "RequestFailedError",
    "RequestOutput",
    "RequestTimeoutError",
    "SamplingParams",
    "ServerConfig",
    "Stream",
    "StreamChunk",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"
