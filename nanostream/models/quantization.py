"""FP8 weight checkpoints: ``quantization_config`` read into an ``Fp8Spec`` (what nanostream does not load is
refused by name), and each FP8 weight dequantized with its scales as it loads.

Two layouts load. In both, a quantized weight ``W`` is stored as ``float8_e4m3fn`` and its real value is
``W × s``, ``s`` its block's, row's or tensor's scale:

- ``quant_method: "fp8"`` (the ``-FP8`` releases of Qwen3, DeepSeek-V3; transformers' FineGrainedFP8Config):
  with ``weight_block_size: [bo, bi]``, one scale per ``bo × bi`` block in ``<W>_scale_inv``, float32
  ``[ceil(out / bo), ceil(in / bi)]`` (edge blocks may be partial), activations ``dynamic``; without it, one
  scale per tensor (``weight_scale_inv`` as transformers writes it, ``weight_scale`` as AutoFP8 does),
  activations ``dynamic`` or ``static``. ``modules_to_not_convert`` names the modules left unquantized.
- ``quant_method: "compressed-tensors"``, ``format: "float-quantized"`` (llm-compressor's FP8 and FP8-Dynamic
  schemes): 8-bit float, symmetric weights per ``channel`` (``weight_scale`` [out, 1]) or per ``tensor``
  ([1]); input activations dynamic per token, static per tensor, or none; ``ignore`` names the modules left
  unquantized (a name, or ``re:`` and a regex matched from the start, as compressed-tensors matches them).
  A ``kv_cache_scheme`` of per-tensor FP8 scales is accepted: its ``self_attn.k_scale`` / ``v_scale`` tensors
  are the KV cache's, not a weight's, and load wherever the model places them.

On a GPU that multiplies FP8 (``load_model``'s ``keep_fp8``), ``keep_fp8_weights`` makes the linear layers
that the checkpoint quantizes keep their FP8 weights and scales (layers/fp8_linear.py), and the loader fills
them as stored. Everywhere else each FP8 weight becomes the model's dtype as it loads (the reference path):
activations are not quantized there, and static input scales (``input_scale``, transformers'
``activation_scale``) are read nowhere: the GPU quantizes activations dynamically.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from nanostream.errors import ModelLoadError
from nanostream.layers import fp8_linear
from nanostream.layers.linear import Linear

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
LOADS = (
    "quant_method 'fp8' (block-wise weight_scale_inv with dynamic activations, or one scale per tensor) and "
    "'compressed-tensors' with format 'float-quantized' (8-bit float weights per channel or per tensor), "
    "besides unquantized weights (bfloat16, float16, float32)"
)
"""What loads, for the refusals' messages."""


@dataclass(frozen=True)
class Fp8Spec:
    """How a checkpoint's FP8 weights are stored (read from ``quantization_config`` by ``fp8_spec``)."""

    method: str
    """``"fp8"`` or ``"compressed-tensors"``: also how ``unquantized`` names are matched."""
    block: tuple[int, int] | None
    """Rows and columns of the weight that one scale covers; None: one scale per row or per tensor."""
    per_channel: bool = False
    """A scale may be per row ([out, 1]); else (without ``block``) it is per tensor ([] or [1])."""
    scale_suffixes: tuple[str, ...] = ("_scale_inv",)
    """What a weight's name takes to name its scale (``q_proj.weight`` -> ``q_proj.weight_scale_inv``)."""
    unread: tuple[str, ...] = ()
    """The last parts of names of checkpoint tensors that nothing reads here (static input scales)."""
    unquantized: tuple[str, ...] = ()
    """The config's ignore list (``modules_to_not_convert``, compressed-tensors' ``ignore``)."""

    def leaves_unquantized(self, module: str) -> bool:
        """Whether ``module`` (a checkpoint name: ``model.layers.1.mlp.down_proj``) is left unquantized.

        compressed-tensors: the name itself, or ``re:`` and a regex matched from the start; ``"fp8"`` (as
        transformers matches it): the name, a module above it, or its trailing parts (``lm_head``, ``mlp.gate``)."""
        for entry in self.unquantized:
            if self.method == "compressed-tensors":
                hit = re.match(entry[3:], module) if entry.startswith("re:") else entry == module
            else:
                hit = re.match(rf"(?:{entry})(?=\.|$)", module) or module.endswith("." + entry)
            if hit:
                return True
        return False

    def is_unread(self, name: str) -> bool:
        return name.rsplit(".", 1)[-1] in self.unread

    def scales(self, names: Collection[str]) -> dict[str, str]:
        """Each quantized weight among the checkpoint's ``names`` and the name of its scale (the weight's name
        and a suffix: ``experts.gate_up_proj_scale_inv`` is ``experts.gate_up_proj``'s); a ``weight_scale``
        or ``weight_scale_inv`` without its weight, or a scale of a module the config leaves unquantized, is
        refused."""
        present = set(names)
        out: dict[str, str] = {}
        for name in present:
            for suffix in self.scale_suffixes:
                weight = name.removesuffix(suffix)
                if weight == name or self.is_unread(name):
                    continue
                if weight not in present:
                    if weight.endswith(".weight"):
                        raise ModelLoadError(f"the checkpoint holds the scale {name} but not its weight {weight}")
                    continue  # not a scale: input_scale, or a tensor with no place in the model
                if weight in out:
                    raise ModelLoadError(f"{weight} has two scales in the checkpoint: {out[weight]} and {name}")
                if self.leaves_unquantized(weight.rsplit(".", 1)[0]):
                    raise ModelLoadError(
                        f"{name}: a scale for a module that quantization_config's ignore list leaves unquantized"
                    )
                out[weight] = name
        return out

    def block_of(self, name: str, shape: tuple[int, ...], stored_fp8: bool, scale: torch.Tensor) -> tuple[int, int]:
        """The rows and columns of weight ``name`` (``shape`` [..., out, in], ``stored_fp8``: as float8_e4m3fn)
        that one entry of ``scale`` covers: the spec's blocks, (1, in) for one per row, (out, in) for one per
        tensor; a weight or scale of another shape is refused."""
        if not stored_fp8 or len(shape) < 2:
            raise ModelLoadError(
                f"{name} is stored as {list(shape)}, not in {FP8_WEIGHT_DTYPE}, with a scale; nanostream reads "
                f"{FP8_WEIGHT_DTYPE} matrices"
            )
        *lead, rows, cols = shape
        got = list(scale.shape)
        if self.block is not None:
            bo, bi = self.block
            expected = [*lead, -(-rows // bo), -(-cols // bi)]
            if got == expected:
                return self.block
            wanted = f"blocks of {bo} x {bi}: {expected}"
        else:
            if scale.numel() == 1 and scale.dim() <= 1:
                return rows, cols
            if self.per_channel and got == [*lead, rows, 1]:
                return 1, cols
            wanted = (f"one per row: {[*lead, rows, 1]}, or " if self.per_channel else "") + "one per tensor: [] or [1]"
        raise ModelLoadError(f"{name} of shape {list(shape)} has a scale of shape {got}; {wanted}")

    def dequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The real values of ``weight`` (``name``: float8_e4m3fn [..., out, in]) with ``scale``, in float32 on
        ``weight``'s device."""
        block = self.block_of(name, tuple(weight.shape), weight.dtype == FP8_WEIGHT_DTYPE, scale)
        s = scale.to(device=weight.device, dtype=torch.float32)
        if s.numel() == 1:
            return weight.to(torch.float32).mul_(s.reshape(()))
        return fp8_linear.dequantize(weight, s, block)


def keep_fp8_weights(model: torch.nn.Module, spec: Fp8Spec, *, gpu_kernels: bool) -> int:
    """Make each linear layer of ``model`` that the checkpoint quantizes hold its weight in FP8
    (``layers.fp8_linear.keep_fp8``), before loading; the number of layers kept.

    A layer stays in the model's dtype (its FP8 weight dequantized on load) where the config's ignore list
    names one of its checkpoint modules, where its rows or columns of the checkpoint (its tensor-parallel
    shard, its part of a fused projection) do not start and end on the scale blocks' edges (nor, for a q/k
    projection whose heads' rows are reordered for the rotary tables, on heads' edges), or, with
    ``gpu_kernels``, where the blocks are not a width the GEMM takes (a power of two from 16 along K)."""
    parts = {(module, shard): name for name, (module, shard) in model.checkpoint_modules.items() if shard}
    block = spec.block
    if gpu_kernels and block is not None and (block[1] < 16 or block[1] & (block[1] - 1)):
        return 0
    rotated_in_place = model.spec.rope.head_order(model.spec.head_dim) is not None
    kept = 0
    for path, layer in model.named_modules():
        if not isinstance(layer, Linear):
            continue
        where, _, leaf = path.rpartition(".")
        names = [n for (m, _), n in parts.items() if m == leaf] if hasattr(layer, "parts") else [leaf]
        if any(spec.leaves_unquantized(model.spec.name_in_checkpoint(f"{where}.{n}")) for n in names or [leaf]):
            continue
        if leaf == "qkv_proj" and block is not None and rotated_in_place and block[0] % model.spec.head_dim:
            continue  # after_loading permutes each head's rows: a block must hold whole heads
        if block is None or layer.can_keep_fp8(block):
            fp8_linear.keep_fp8(layer, block)
            kept += 1
    return kept


def weights_dtype(model: torch.nn.Module) -> str:
    """The weights' dtype for the start-up line: the model's, or that and how many linear layers keep FP8."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    kept = [m for m in linears if m.fp8_block is not None]
    dtype = str(next(p.dtype for p in model.parameters() if p.dtype != FP8_WEIGHT_DTYPE)).removeprefix("torch.")
    if not kept:
        return dtype
    return f"{dtype}, {len(kept)} of {len(linears)} linear layers in float8_e4m3fn"


def fp8_spec(config: Any, model: str) -> Fp8Spec | None:
    """The FP8 layout ``config`` (config.json's ``quantization_config``, a dict or transformers' object) names;
    None without one. What nanostream does not load is refused with the method, format or field named."""
    if not config:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    method = config.get("quant_method", "unnamed")
    if method == "fp8":
        return _fp8(config, model)
    if method == "compressed-tensors":
        return _compressed_tensors(config, model)
    raise ModelLoadError(
        f"{model} checkpoint quantized with {method!r} (quantization_config in config.json): nanostream loads "
        f"{LOADS}; use one of those"
    )


def _refuse(model: str, field: str, value: Any, why: str = "") -> ModelLoadError:
    return ModelLoadError(
        f"{model} checkpoint with quantization_config {field}={value!r}{why}: nanostream loads {LOADS}"
    )


def _names(config: dict, key: str, model: str) -> tuple[str, ...]:
    names = config.get(key) or []
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise _refuse(model, key, names, " (a list of module names expected)")
    return tuple(names)


def _fp8(config: dict, model: str) -> Fp8Spec:
    for key, allowed in (("fmt", "e4m3"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
        if config.get(key, allowed) not in (allowed, None):
            raise _refuse(model, key, config[key])
    key = "modules_to_not_convert" if config.get("modules_to_not_convert") is not None else "ignored_layers"
    unquantized = _names(config, key, model)  # ignored_layers: MiniMax's name for it
    scheme = config.get("activation_scheme", "dynamic")
    block = config.get("weight_block_size")
    if block is None:  # one scale per tensor, as vLLM and AutoFP8 read a config without a block size
        if scheme not in ("dynamic", "static"):
            raise _refuse(model, "activation_scheme", scheme)
        unread = ("input_scale", "activation_scale") if scheme == "static" else ()
        return Fp8Spec("fp8", None, scale_suffixes=("_scale_inv", "_scale"), unread=unread, unquantized=unquantized)
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise _refuse(model, "weight_block_size", block, " (two positive integers expected)")
    if scheme != "dynamic":
        raise _refuse(model, "activation_scheme", scheme, " with weight_block_size (block-wise FP8 is dynamic)")
    return Fp8Spec("fp8", (block[0], block[1]), unquantized=unquantized)


# compressed-tensors' QuantizationArgs defaults, for fields a config leaves out (strategy: what it infers
# without a group size or block structure).
_ARGS_DEFAULTS = dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False,
                      group_size=None, block_structure=None, actorder=None)  # fmt: skip


def _check_args(args: Any, where: str, model: str, **allowed: tuple) -> dict:
    if not isinstance(args, dict):
        raise _refuse(model, where, args)
    for key, values in allowed.items():
        value = args.get(key, _ARGS_DEFAULTS[key])
        if value not in values or isinstance(value, bool) != isinstance(values[0], bool):
            raise _refuse(model, f"{where}.{key}", value)
    return args


def _compressed_tensors(config: dict, model: str) -> Fp8Spec:
    if config.get("format") != "float-quantized":
        raise _refuse(model, "format", config.get("format"))
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(model, "config_groups", groups)
    plain = dict(num_bits=(8,), type=("float",), symmetric=(True,), group_size=(None,), block_structure=(None,))
    per_channel = static = False
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise _refuse(model, where, group)
        if group.get("format") not in (None, "float-quantized"):
            raise _refuse(model, f"{where}.format", group["format"])
        weights = _check_args(group.get("weights"), f"{where}.weights", model, **plain,
                              strategy=("channel", "tensor"), dynamic=(False,), actorder=(None,))  # fmt: skip
        per_channel |= weights.get("strategy") == "channel"
        inputs = group.get("input_activations")
        if inputs is not None:
            _check_args(inputs, f"{where}.input_activations", model, **plain,
                        strategy=("token", "tensor"), dynamic=(True, False))  # fmt: skip
            if (inputs.get("strategy"), bool(inputs.get("dynamic"))) not in (("token", True), ("tensor", False)):
                raise _refuse(model, f"{where}.input_activations", inputs, " (dynamic per token or static per tensor)")
            static |= not inputs.get("dynamic")
        if group.get("output_activations") is not None:
            raise _refuse(model, f"{where}.output_activations", group["output_activations"])
    kv = config.get("kv_cache_scheme")
    if kv is not None:
        _check_args(kv, "kv_cache_scheme", model, **plain, strategy=("tensor",), dynamic=(False,))
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise _refuse(model, "sparsity_config.format", sparsity["format"])
    if config.get("transform_config"):
        raise _refuse(model, "transform_config", config["transform_config"], " (online transforms)")
    return Fp8Spec(
        "compressed-tensors",
        None,
        per_channel=per_channel,
        scale_suffixes=("_scale",),
        unread=("input_scale",) * static,
        unquantized=_names(config, "ignore", model),
    )
