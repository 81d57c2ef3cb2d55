"""Gemma 3's vision tower: a SigLIP vision transformer and Gemma 3's multimodal projector, one square image size.

    patches [B*N, C*p*p] -> patch embedding (the Conv2d as one Linear) + learned positions -> [B, N, D]
      -> layers x (LayerNorm -> attention among one image's patches -> LayerNorm -> GELU MLP), residual
      -> post LayerNorm -> average of each merge x merge patches -> RMSNorm (1 + w) -> @ W [D, text] -> [B*T, text]

An image is its N = side² patches row-major over the patch grid, each flattened as the Conv2d weight [D, C, p, p]
flattens (channel, row, column); its grid is (1, side, side) and it becomes ``mm_tokens_per_image`` tokens.
Parameter names are transformers' (``vision_model.*``, ``multi_modal_projector.*``), so a checkpoint's tensors load
by name (``checkpoint_prefixes``, models/vision/weights.py)::

    spec = SiglipSpec.from_config(AutoConfig.from_pretrained(path))   # a Gemma3Config
    encoder = SiglipEncoder(spec)
    load_vision_weights(encoder, path, encoder.checkpoint_prefixes)
    (rows, _), = encoder(pixels, [spec.grid]).split()                 # rows: [mm_tokens_per_image, text hidden]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.errors import ModelLoadError
from nanostream.models.vision.qwen_vit import VisionOutput
from nanostream.models.vision.qwen_vit_spec import VISION_ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class SiglipSpec:
    """A SigLIP tower of ``num_hidden_layers`` layers of ``hidden_size`` over square images of ``image_size`` pixels
    in ``patch_size`` patches, and Gemma 3's projector to ``mm_tokens_per_image`` tokens of ``text_hidden_size``."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    mm_tokens_per_image: int
    text_hidden_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6  # the tower's LayerNorms'
    projector_norm_eps: float = 1e-6  # mm_soft_emb_norm's (transformers gives it the tower's layer_norm_eps)
    gelu_approximate: str = "tanh"

    @property
    def side(self) -> int:
        """Patches a side of the (square) image."""
        return self.image_size // self.patch_size

    @property
    def spatial_merge_size(self) -> int:
        """Patches a side that one token averages: patches a side over tokens a side."""
        return self.side // math.isqrt(self.mm_tokens_per_image)

    @property
    def patch_pixels(self) -> int:
        """Values of one patch row: channels x patch x patch."""
        return self.num_channels * self.patch_size**2

    @property
    def grid(self) -> tuple[int, int, int]:
        """The one grid the tower takes: (1, side, side)."""
        return (1, self.side, self.side)

    def grid_error(self, grid: Sequence[int]) -> str | None:
        """Why the tower cannot take an image of ``grid`` (t, h, w), or None where it can."""
        if tuple(int(v) for v in grid) == self.grid:
            return None
        return (
            f"the patch grid {tuple(grid)} is not {self.grid}: this vision tower takes images of {self.image_size}x"
            f"{self.image_size} pixels in {self.patch_size}-pixel patches, as the model's image processor resizes them"
        )

    def __post_init__(self) -> None:
        tokens_side = math.isqrt(self.mm_tokens_per_image)
        if self.image_size % self.patch_size or tokens_side**2 != self.mm_tokens_per_image or self.side % tokens_side:
            raise ModelLoadError(
                f"vision image_size {self.image_size} in {self.patch_size}-pixel patches cannot be pooled to "
                f"mm_tokens_per_image {self.mm_tokens_per_image}: it takes a square number of tokens whose side "
                "divides the patches a side"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ModelLoadError(
                f"vision hidden_size {self.hidden_size} does not divide into {self.num_attention_heads} heads"
            )

    @classmethod
    def from_config(cls, config: Any) -> SiglipSpec:
        """The spec of a ``Gemma3Config`` (or config.json's dict): its vision_config, mm_tokens_per_image and the
        text model's hidden size."""
        cfg = config if isinstance(config, dict) else config.to_dict()
        vision, text = cfg["vision_config"], cfg["text_config"]
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act not in VISION_ACTIVATIONS:
            raise ModelLoadError(f"vision hidden_act {act!r} is not supported; use one of {sorted(VISION_ACTIVATIONS)}")
        eps = float(vision.get("layer_norm_eps", 1e-6))
        return cls(
            **{f: vision[f] for f in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")},
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            mm_tokens_per_image=cfg.get("mm_tokens_per_image", 256),
            text_hidden_size=text["hidden_size"],
            num_channels=vision.get("num_channels", 3),
            layer_norm_eps=eps,
            projector_norm_eps=eps,
            gelu_approximate=VISION_ACTIVATIONS[act],
        )


class SiglipEmbeddings(nn.Module):
    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.shape = (spec.num_channels, spec.patch_size, spec.patch_size)
        p = spec.patch_size
        self.patch_embedding = nn.Conv2d(spec.num_channels, spec.hidden_size, kernel_size=p, stride=p)
        self.position_embedding = nn.Embedding(spec.side**2, spec.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # patches [B, N, C*p*p]. The stride-p convolution over the image is a Linear over its patch rows, but
        # convolving each patch as transformers convolves the image keeps float32 outputs equal to the bit
        b, n, _ = patches.shape
        x = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype).reshape(b * n, *self.shape))
        return x.view(b, n, -1) + self.position_embedding.weight  # [B, N, D]


class SiglipAttention(nn.Module):
    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.heads = spec.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(spec.hidden_size, spec.hidden_size) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        # [B, H, N, Dh]: every image of the batch has the same N patches, each attends within its own image only
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class SiglipMLP(nn.Module):
    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)
        self.approximate = spec.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class SiglipLayer(nn.Module):
    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = SiglipAttention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = SiglipMLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVisionModel(nn.Module):
    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(spec)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipLayer(spec) for _ in range(spec.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(patches)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: computed in float32, scaled by 1 + w."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)


class GemmaProjector(nn.Module):
    """merge x merge patches averaged into one token, normed, projected to the language model's width."""

    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.side, self.merge = spec.side, spec.spatial_merge_size
        self.mm_input_projection_weight = nn.Parameter(torch.empty(spec.hidden_size, spec.text_hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(spec.hidden_size, spec.projector_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape  # [B, side², D], patches row-major
        grid = x.transpose(1, 2).reshape(b, d, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.merge).flatten(2).transpose(1, 2)  # [B, T, D], tokens row-major
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).to(x.dtype)


class SiglipEncoder(nn.Module):
    """Gemma 3's vision tower and projector; see the module docstring. Takes a batch of images of its one grid."""

    unused = ("vision_model.head.",)  # SigLIP's pooling head (``vision_use_head``): Gemma 3's features skip it
    checkpoint_prefixes = {
        "vision_model.": (
            "vision_tower.vision_model.",  # published
            "model.vision_tower.vision_model.",
            "vision_tower.",  # transformers 5's save_pretrained: the SiglipVisionModel has no vision_model level
            "model.vision_tower.",
        ),
        "multi_modal_projector.": ("multi_modal_projector.", "model.multi_modal_projector."),
    }
    """The encoder's names -> the checkpoint's, the first one present: the published layout, transformers 5's."""

    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.spec = spec
        self.vision_model = SiglipVisionModel(spec)
        self.multi_modal_projector = GemmaProjector(spec)

    def forward(self, pixels: torch.Tensor, grids: torch.Tensor | Sequence[Sequence[int]]) -> VisionOutput:
        """``pixels`` [images x side², C*p*p] (each image's patch rows, back to back), ``grids`` one (1, side, side)
        an image. ValueError for another grid or a number of rows unlike the grids'."""
        spec = self.spec
        grids = grids.tolist() if torch.is_tensor(grids) else list(grids)
        for grid in grids:
            if (error := spec.grid_error(grid)) is not None:
                raise ValueError(error)
        n = spec.side**2
        if pixels.dim() != 2 or pixels.shape != (len(grids) * n, spec.patch_pixels):
            raise ValueError(
                f"pixels have shape {tuple(pixels.shape)}; {len(grids)} images take [{len(grids) * n}, "
                f"{spec.patch_pixels}] (each image's {n} patch rows)"
            )
        x = self.vision_model(pixels.view(len(grids), n, spec.patch_pixels))
        rows = self.multi_modal_projector(x).flatten(0, 1)  # [B*T, text hidden]
        return VisionOutput(embeds=rows, deepstack=(), tokens_per_image=(spec.mm_tokens_per_image,) * len(grids))
