"""gpt-oss's mixture-of-experts block: nanostream's ``SparseMoE`` with the gpt-oss options of ``MoESpec`` against
transformers' ``GptOssMLP`` on the same random weights, loaded from what ``save_pretrained`` writes; at one rank and
split over two (gloo ranks as threads, tests/test_tp.py's pattern); random (dummy) weights.

The weights are large enough that the clamped SwiGLU's limit is reached on both sides and the router's bias
changes which experts are picked. The routing is bit-equal to transformers' (the same ops on the same values); the
block's output equals it to float32 rounding, not to the bit: transformers multiplies by the checkpoint's
[E, H, 2I] layout, nanostream by its [E, 2I, H] one (the fused kernel's), and the CPU BLAS sums a one-row product
(an expert that got one token) in an order that depends on the layout. test_fused_moe.py checks the Triton
kernel's biases and activation against the torch path; the whole model's parity comes with the decoder's support.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_tp import in_threads
from torch import nn
from transformers import GptOssConfig, GptOssForCausalLM

from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.kernels.expert_ops import ClampedSwiGLU
from nanostream.kernels.fused_moe import fused_moe
from nanostream.layers.activation import SiluAndMul, silu_and_mul
from nanostream.layers.moe import SparseMoE
from nanostream.layers.moe_reference import moe_experts
from nanostream.layers.moe_spec import MoEFn, MoESpec
from nanostream.models.loader import load_dummy_weights, load_weights

CONFIG = dict(
    hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
)  # fmt: skip
LAYER_TENSORS = {"router.weight", "router.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias",
                 "experts.down_proj", "experts.down_proj_bias"}  # fmt: skip


def gpt_oss_spec(config: GptOssConfig) -> MoESpec:
    """The MoE layers of a GptOssConfig, as models/config_reader.py is to read them."""
    return MoESpec(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        renormalize=False,
        float32_weights=False,
        layers=tuple(range(config.num_hidden_layers)),
        router_bias=True,
        softmax_after_topk=True,
        activation=ClampedSwiGLU(alpha=config.swiglu_alpha, limit=config.swiglu_limit),
        expert_bias=True,
        transposed_experts=True,
        interleaved_gate_up=True,
    )


class Layer(nn.Module):
    def __init__(self, mlp: SparseMoE) -> None:
        super().__init__()
        self.mlp = mlp


class Blocks(nn.Module):
    """A gpt-oss model's MoE blocks under their checkpoint names (``model.layers.{i}.mlp``), with the checkpoint
    maps a decoder declares for gpt-oss: ``router`` is the block's ``gate``; the stacked experts and biases."""

    checkpoint_aliases = {"router": "gate"}
    checkpoint_stacked_experts = {
        "gate_up_proj": ("w13", "gate_up"),
        "down_proj": ("w2", "down"),
        "gate_up_proj_bias": ("w13_bias", "gate_up"),
        "down_proj_bias": ("w2_bias", "down"),
    }

    def __init__(self, spec: MoESpec, hidden: int, kernel: MoEFn = moe_experts, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        part = spec.intermediate_size // tp.size
        rows = range(tp.rank * part, (tp.rank + 1) * part)
        act = SiluAndMul(silu_and_mul)  # a shared expert's; gpt-oss has none
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            Layer(SparseMoE(hidden, spec, rows, range(0), kernel, act, tp)) for _ in spec.layers
        )

    def mlp(self, i: int) -> SparseMoE:
        return self.model.layers[i].mlp


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(transformers' model with large random MoE weights, a directory of its MoE tensors as save_pretrained wrote
    them, the config)."""
    config = GptOssConfig(**CONFIG)
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    hidden, inter, experts = config.hidden_size, config.intermediate_size, config.num_local_experts
    with torch.no_grad():
        for layer in model.model.layers:
            router, ex = layer.mlp.router, layer.mlp.experts
            router.weight.copy_(torch.randn(experts, hidden, generator=gen) / hidden**0.5)
            router.bias.copy_(torch.randn(experts, generator=gen))
            ex.gate_up_proj.copy_(torch.randn(experts, hidden, 2 * inter, generator=gen))  # pre-activations ~N(0, 64)
            ex.gate_up_proj_bias.copy_(torch.randn(experts, 2 * inter, generator=gen))
            ex.down_proj.copy_(torch.randn(experts, inter, hidden, generator=gen) / inter**0.5)
            ex.down_proj_bias.copy_(torch.randn(experts, hidden, generator=gen))
    saved = tmp_path_factory.mktemp("saved")
    model.save_pretrained(saved)
    tensors = load_file(saved / "model.safetensors")
    checkpoint = tmp_path_factory.mktemp("moe_tensors")
    save_file({k: v for k, v in tensors.items() if ".mlp." in k}, checkpoint / "model.safetensors")
    return model, checkpoint, config


def test_save_pretrained_writes_the_experts_stacked_transposed_with_gate_and_up_interleaved(gpt_oss):
    model, checkpoint, config = gpt_oss
    tensors = load_file(checkpoint / "model.safetensors")
    prefix = "model.layers.1.mlp."
    assert {k.removeprefix(prefix) for k in tensors if k.startswith(prefix)} == LAYER_TENSORS
    experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
    assert tensors[prefix + "experts.gate_up_proj"].shape == (experts, hidden, 2 * inter)
    assert tensors[prefix + "experts.down_proj"].shape == (experts, inter, hidden)
    blocks = Blocks(gpt_oss_spec(config), hidden)
    load_weights(blocks, checkpoint)
    ours, theirs = blocks.mlp(1).experts, model.model.layers[1].mlp.experts
    gate_up = theirs.gate_up_proj.detach()  # [E, H, 2I]: gate, up, gate, up, ...
    assert torch.equal(ours.w13[:, :inter], gate_up[..., ::2].transpose(1, 2))  # gate rows first
    assert torch.equal(ours.w13[:, inter:], gate_up[..., 1::2].transpose(1, 2))
    assert torch.equal(
        ours.w13_bias, torch.cat([theirs.gate_up_proj_bias[:, ::2], theirs.gate_up_proj_bias[:, 1::2]], 1)
    )
    assert torch.equal(ours.w2, theirs.down_proj.detach().transpose(1, 2))


@pytest.mark.parametrize("kernel", [moe_experts, fused_moe], ids=["torch", "triton"])
def test_the_block_matches_transformers_gpt_oss_mlp(gpt_oss, kernel):
    model, checkpoint, config = gpt_oss
    blocks = Blocks(gpt_oss_spec(config), config.hidden_size, kernel)
    load_weights(blocks, checkpoint)
    limit = config.swiglu_limit
    gen = torch.Generator().manual_seed(2)
    for i, layer in enumerate(model.model.layers):
        x = torch.randn(37, config.hidden_size, generator=gen)
        theirs = layer.mlp
        with torch.no_grad():
            expected = theirs(x[None])[0][0]
            _, scores, ids = theirs.router(x)
            weights, our_ids = blocks.mlp(i).gate(x)
            out = blocks.mlp(i)(x)
            unbiased = F.linear(x, theirs.router.weight).topk(config.num_experts_per_tok).indices
            pre = (
                torch.einsum("th,tkhn->tkn", x, theirs.experts.gate_up_proj[ids])
                + theirs.experts.gate_up_proj_bias[ids]
            )
        assert torch.equal(our_ids, ids) and torch.equal(weights, scores)  # the same experts, the same weights
        assert (unbiased != ids).any()  # the router's bias changes the choice
        gate, up = pre[..., ::2], pre[..., 1::2]  # [T, K, I]: the routed pairs' pre-activations
        assert (gate > limit).any() and (up > limit).any() and (up < -limit).any()  # the clamp bites
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


def test_two_ranks_split_every_expert_and_add_the_down_bias_once(gpt_oss):
    model, checkpoint, config = gpt_oss
    spec = gpt_oss_spec(config)
    x = torch.randn(21, config.hidden_size, generator=torch.Generator().manual_seed(3))

    def rank(tp: TensorParallel):
        blocks = Blocks(spec, config.hidden_size, tp=tp)
        load_weights(blocks, checkpoint)  # each rank reads its half of every expert's intermediate rows
        experts = blocks.mlp(0).experts
        with torch.no_grad():
            return blocks.mlp(0)(x), experts.adds_down_bias, experts.w13_bias.detach().clone()

    out = in_threads(2, rank)
    with torch.no_grad():
        expected = model.model.layers[0].mlp(x[None])[0][0]
    bias = model.model.layers[0].mlp.experts.gate_up_proj_bias.detach()  # [E, 2I], interleaved
    half = config.intermediate_size // 2
    for r, (y, adds_down_bias, w13_bias) in out.items():
        assert adds_down_bias == (r == 0)
        mine = bias[:, 2 * r * half : 2 * (r + 1) * half]  # this rank's gate and up entries, interleaved
        assert torch.equal(w13_bias, torch.cat([mine[:, ::2], mine[:, 1::2]], 1))
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)  # the sum over ranks: all of it, bias once
    assert torch.equal(out[0][0], out[1][0])


def test_dummy_weights_fill_the_biases_small_and_run(gpt_oss):
    _, _, config = gpt_oss
    blocks = Blocks(gpt_oss_spec(config), config.hidden_size)
    load_dummy_weights(blocks)
    experts = blocks.mlp(0).experts
    assert experts.w13_bias.std() < 0.03 and experts.w2_bias.std() < 0.03  # biases' N(0, 0.02^2), not a matrix's
    assert blocks.mlp(0).gate.bias.std() < 0.03
    with torch.no_grad():
        y = blocks.mlp(0)(torch.randn(5, config.hidden_size))
    assert torch.isfinite(y).all() and y.abs().max() > 0


def test_a_checkpoint_laid_out_otherwise_than_the_spec_says_is_refused_with_the_shapes(gpt_oss):
    _, checkpoint, config = gpt_oss
    spec = gpt_oss_spec(config)
    untransposed = dataclasses.replace(spec, transposed_experts=False)
    shapes = (
        r"gate_up tensor of shape \(8, 64, 96\), expected \(8, 96, 64\)|down tensor of shape \(8, 48, 64\), expected"
    )
    with pytest.raises(ValueError, match=shapes):
        load_weights(Blocks(untransposed, config.hidden_size), checkpoint)


def test_moe_spec_refuses_options_that_do_not_go_together():
    with pytest.raises(ValueError, match="leave renormalize and float32_weights False"):
        MoESpec(8, 2, 16, renormalize=True, float32_weights=False, layers=(0,), softmax_after_topk=True)
    with pytest.raises(ValueError, match=r"one of \('silu', 'gelu_tanh'\) or a ClampedSwiGLU, not 'gelu'"):
        MoESpec(8, 2, 16, renormalize=False, float32_weights=False, layers=(0,), activation="gelu")
    with pytest.raises(ValueError, match="normed_softmax routes the experts beside a dense MLP"):
        MoESpec(8, 2, 16, renormalize=True, float32_weights=True, layers=(0,), router="normed_softmax")
