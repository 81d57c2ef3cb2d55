"""Gemma 4's vision tower and its multimodal embedder: images of any shape in patches, pooled k x k to tokens.

    patches [N, 3*p*p] in [0, 1] -> Linear(2x - 1) + x- and y-embeddings of the patch's column and row -> [N, D]
      -> layers x (RMSNorm -> attention among one image's patches, q/k RMSNormed and turned by a 2-D rotary, v
         RMSNormed without scale -> RMSNorm, residual; RMSNorm -> GeGLU MLP -> RMSNorm, residual)
      -> average of each k x k patches (float32) x sqrt(D) [-> (x - std_bias) * std_scale]
      -> RMSNorm without scale -> @ W [D, text] -> [T, text],  T = h*w / k²

An image is the rows transformers' Gemma 4 image processor gives it, without the padding rows: its h*w patches
row-major over the patch grid, each flattened (row, column, channel); its grid is (1, h, w) in patches, h and w
multiples of ``pooling_kernel_size``, and its tokens are row-major over the (h/k, w/k) grid of pooled patches.
Parameter names are transformers' (``vision_tower.*``, ``embed_vision.*``, under ``model.`` in published and
save_pretrained checkpoints; its buffers ``std_bias``/``std_scale`` and the clipped linears' bounds are parameters
here, so they load by name)::

    spec = Gemma4VisionSpec.from_config(AutoConfig.from_pretrained(path))   # a Gemma4Config
    encoder = Gemma4VisionEncoder(spec)
    load_vision_weights(encoder, path, encoder.checkpoint_prefixes)
    (rows, _), = encoder(pixels, [(1, h, w)]).split()                       # rows: [h*w // k², text hidden]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.models.vision.gemma4_vit_spec import Gemma4VisionSpec
from nanostream.models.vision.qwen_vit import VisionOutput


class Gemma4Norm(nn.Module):
    """Gemma 4's RMSNorm: in float32, x * mean(x²)^-1/2 (``torch.pow`` as transformers'), times w where scaled."""

    def __init__(self, width: int, eps: float, scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (out if self.weight is None else out * self.weight.float()).type_as(x)


class ClippableLinear(nn.Module):
    """A bias-free Linear whose input and output may be clamped to bounds the checkpoint holds."""

    def __init__(self, spec: Gemma4VisionSpec, width_in: int, width_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out, bias=False)
        self.clipped = spec.use_clipped_linears
        if self.clipped:
            for name, bound in (("input_min", -1), ("input_max", 1), ("output_min", -1), ("output_max", 1)):
                setattr(self, name, nn.Parameter(torch.tensor(bound * float("inf")), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        return torch.clamp(
            self.linear(torch.clamp(x, self.input_min, self.input_max)), self.output_min, self.output_max
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, N, H, Dh]; cos, sin [B, N, Dh]: the first half of each head turns by the column, the second by the row
    parts = []
    for xp, c, s in zip(x.chunk(2, -1), cos.unsqueeze(2).chunk(2, -1), sin.unsqueeze(2).chunk(2, -1)):
        x1, x2 = xp.chunk(2, -1)
        parts.append(xp * c + torch.cat((-x2, x1), -1) * s)
    return torch.cat(parts, -1)


class Gemma4Attention(nn.Module):
    def __init__(self, spec: Gemma4VisionSpec) -> None:
        super().__init__()
        d, dh = spec.hidden_size, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, dh
        self.q_proj = ClippableLinear(spec, d, self.heads * dh)
        self.k_proj = ClippableLinear(spec, d, self.kv_heads * dh)
        self.v_proj = ClippableLinear(spec, d, self.kv_heads * dh)
        self.o_proj = ClippableLinear(spec, self.heads * dh, d)
        self.q_norm = Gemma4Norm(dh, spec.rms_norm_eps)
        self.k_norm = Gemma4Norm(dh, spec.rms_norm_eps)
        self.v_norm = Gemma4Norm(dh, spec.rms_norm_eps, scale=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = _rotate(self.q_norm(self.q_proj(x).view(b, n, -1, self.head_dim)), *rope).transpose(1, 2)
        k = _rotate(self.k_norm(self.k_proj(x).view(b, n, -1, self.head_dim)), *rope).transpose(1, 2)
        v = self.v_norm(self.v_proj(x).view(b, n, -1, self.head_dim)).transpose(1, 2)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, H, N, Dh]
        # mask [B, 1, 1, N]: each image's queries see its own patches, never the padding after them; no 1/sqrt(Dh)
        # scale, as the q/k norms set the logits' size
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class Gemma4MLP(nn.Module):
    def __init__(self, spec: Gemma4VisionSpec) -> None:
        super().__init__()
        d, f = spec.hidden_size, spec.intermediate_size
        self.gate_proj, self.up_proj = ClippableLinear(spec, d, f), ClippableLinear(spec, d, f)
        self.down_proj = ClippableLinear(spec, f, d)
        self.approximate = spec.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate=self.approximate) * self.up_proj(x))


class Gemma4Layer(nn.Module):
    def __init__(self, spec: Gemma4VisionSpec) -> None:
        super().__init__()
        d, eps = spec.hidden_size, spec.rms_norm_eps
        self.self_attn, self.mlp = Gemma4Attention(spec), Gemma4MLP(spec)
        self.input_layernorm, self.post_attention_layernorm = Gemma4Norm(d, eps), Gemma4Norm(d, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = Gemma4Norm(d, eps), Gemma4Norm(d, eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4PatchEmbedder(nn.Module):
    def __init__(self, spec: Gemma4VisionSpec) -> None:
        super().__init__()
        self.input_proj = nn.Linear(spec.patch_pixels, spec.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.ones(2, spec.position_embedding_size, spec.hidden_size))

    def forward(self, patches: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
        # patches [B, N, 3*p*p] in [0, 1], scaled to [-1, 1] here (the processor leaves them unnormalised);
        # xy [B, N, 2]: each patch's column and row (padding's: 0, its rows are dropped at the end)
        x = self.input_proj((2 * (patches - 0.5)).to(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        return x + (F.embedding(xy[..., 0], table[0]) + F.embedding(xy[..., 1], table[1]))


class Gemma4VisionModel(nn.Module):
    """The tower to its pooled, scaled (and standardised) features: transformers' ``Gemma4VisionModel``."""

    def __init__(self, spec: Gemma4VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embedder = Gemma4PatchEmbedder(spec)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(Gemma4Layer(spec) for _ in range(spec.num_hidden_layers))
        quarter = torch.arange(0, spec.head_dim // 2, 2, dtype=torch.float) / (spec.head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / spec.rope_theta**quarter, persistent=False)  # [Dh/4]
        if spec.standardize:
            self.std_bias = nn.Parameter(torch.zeros(spec.hidden_size), requires_grad=False)
            self.std_scale = nn.Parameter(torch.ones(spec.hidden_size), requires_grad=False)

    def rope(self, xy: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = xy[..., None].float() * self.inv_freq  # [B, N, 2, Dh/4]
        cos, sin = (
            torch.cat([f[..., 0, :]] * 2 + [f[..., 1, :]] * 2, -1).to(dtype) for f in (angles.cos(), angles.sin())
        )
        return cos, sin  # [B, N, Dh]: (column, column, row, row)

    def forward(self, patches: torch.Tensor, xy: torch.Tensor, valid: torch.Tensor, pool: torch.Tensor):
        """patches [B, N, 3*p*p], xy [B, N, 2], valid [B, N] (False: padding), pool [B, T, N] (each token's share
        of each patch: 1/k² or 0) -> [B, T, D] float32."""
        x = self.patch_embedder(patches, xy)
        rope, mask = self.rope(xy, x.dtype), valid[:, None, None, :]
        for layer in self.encoder.layers:
            x = layer(x, rope, mask)
        x = x.masked_fill(~valid[..., None], 0.0)
        # the average in float32, as a product with each token's shares (transformers' order of sums); scaled by
        # sqrt(D) in float32, as the magnitude may pass float16's range before standardising
        pooled = (pool @ x.float()) * self.spec.hidden_size**0.5
        if self.spec.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled


class Gemma4Embedder(nn.Module):
    """The tower's features to the language model's width: RMSNorm without scale, then a bias-free Linear."""

    def __init__(self, spec: Gemma4VisionSpec) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = Gemma4Norm(spec.hidden_size, spec.rms_norm_eps, scale=False)
        self.embedding_projection = nn.Linear(spec.hidden_size, spec.text_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class Gemma4VisionEncoder(nn.Module):
    """Gemma 4's vision tower and embedder; see the module docstring. Takes a batch of images of any grids it takes
    (``spec.grid_error``), each attending within itself."""

    checkpoint_prefixes = {
        "vision_tower.": ("model.vision_tower.", "vision_tower."),
        "embed_vision.": ("model.embed_vision.", "embed_vision."),
    }
    """The encoder's names -> the checkpoint's, the first one present: published and save_pretrained's, bare."""

    def __init__(self, spec: Gemma4VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.vision_tower = Gemma4VisionModel(spec)
        self.embed_vision = Gemma4Embedder(spec)

    def forward(self, pixels: torch.Tensor, grids: torch.Tensor | Sequence[Sequence[int]]) -> VisionOutput:
        """``pixels`` [sum of h*w, 3*p*p] (each image's patch rows, back to back), ``grids`` one (1, h, w) an image.
        ValueError for a grid the tower cannot take or a number of rows unlike the grids'."""
        spec = self.spec
        grids = [tuple(int(v) for v in g) for g in (grids.tolist() if torch.is_tensor(grids) else grids)]
        for grid in grids:
            if (error := spec.grid_error(grid)) is not None:
                raise ValueError(error)
        sizes = [h * w for _, h, w in grids]
        if pixels.dim() != 2 or pixels.shape != (sum(sizes), spec.patch_pixels):
            raise ValueError(
                f"pixels have shape {tuple(pixels.shape)}; images of grids {grids} take [{sum(sizes)}, "
                f"{spec.patch_pixels}] (each image's h*w patch rows)"
            )
        b, n, k = len(grids), max(sizes), spec.pooling_kernel_size
        tokens = [spec.num_tokens(g) for g in grids]
        device = pixels.device
        patches = pixels.new_zeros(b, n, spec.patch_pixels)
        xy = torch.zeros(b, n, 2, dtype=torch.long, device=device)
        valid = torch.zeros(b, n, dtype=torch.bool, device=device)
        pool = torch.zeros(b, max(tokens), n, device=device)
        for i, ((_, h, w), rows) in enumerate(zip(grids, pixels.split(sizes))):
            col, row = torch.arange(w, device=device).repeat(h), torch.arange(h, device=device).repeat_interleave(w)
            patches[i, : h * w], valid[i, : h * w] = rows, True
            xy[i, : h * w] = torch.stack([col, row], -1)
            token = col // k + (w // k) * (row // k)  # the pooled token of each patch, row-major
            pool[i, token, torch.arange(h * w, device=device)] = 1.0 / k**2
        pooled = self.vision_tower(patches, xy, valid, pool)  # [B, T, D] float32
        features = torch.cat([pooled[i, :t] for i, t in enumerate(tokens)]).to(
            self.embed_vision.embedding_projection.weight.dtype
        )
        return VisionOutput(embeds=self.embed_vision(features), deepstack=(), tokens_per_image=tuple(tokens))
