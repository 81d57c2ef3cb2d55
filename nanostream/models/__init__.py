"""Models: the shared decoder (decoder.py, its layers in decoder_layer.py) and its shape (spec.py), the
architectures it runs (architectures.py), reading a config.json (model_config.py) into a spec (config_reader.py),
how the decoder splits over tensor-parallel ranks (sharding.py), loading weights (loader.py, quantization.py).
May import layers/, distributed/ and nanostream's errors; the engine imports this, never the reverse.

``load_model`` builds the decoder for a config.json and fills it from the checkpoint::

    spec = decoder_spec(hf_config, max_model_len=4096)
    model = load_model(spec, LayerKernels(TorchAttention()), path, dtype=torch.float32, device=torch.device("cpu"))
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.layers.fp8_linear import fp8_gemm_available
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.models.architectures import ARCHITECTURES, SUPPORTED_ARCHITECTURES
from nanostream.models.config_reader import decoder_spec
from nanostream.models.decoder import DecoderForCausalLM
from nanostream.models.loader import checkpoint_files, load_dummy_weights, load_weights
from nanostream.models.placeholder_embeds import PlaceholderEmbeds
from nanostream.models.quantization import keep_fp8_weights
from nanostream.models.spec import DecoderSpec

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "DecoderForCausalLM",
    "DecoderSpec",
    "PlaceholderEmbeds",
    "decoder_spec",
    "load_model",
]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    spec: DecoderSpec,
    kernels: LayerKernels,
    path: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel = SINGLE,
    load_format: str = "auto",
    keep_fp8: bool | None = None,
) -> DecoderForCausalLM:
    """The decoder of ``spec``, built on ``device`` in ``dtype`` with ``kernels``, weights from ``path``, eval mode.
    With ``tp`` of several ranks: this rank's shard, read alone from the files. ``load_format="dummy"``:
    random weights of the config's shapes instead (``path`` needs no weight files).

    An FP8 checkpoint's linear layers keep their FP8 weights where ``keep_fp8`` (None: where ``device``
    multiplies FP8, a GPU of sm89 or newer); otherwise they dequantize to ``dtype`` as they load."""
    if load_format != "dummy":
        checkpoint_files(Path(path))  # none is a ModelLoadError now, before the model takes its memory
    with _default_dtype(dtype), torch.device(device):
        model = DecoderForCausalLM(spec, kernels, tp)
    if spec.quantization is not None and (fp8_gemm_available(device) if keep_fp8 is None else keep_fp8):
        keep_fp8_weights(model, spec.quantization, gpu_kernels=device.type == "cuda")
    if load_format == "dummy":
        load_dummy_weights(model)
    else:
        load_weights(model, path)
    model.after_loading()
    return model.eval()
