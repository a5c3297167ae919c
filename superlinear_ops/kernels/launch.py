"""What every span-kernel launcher takes: the prepared tensors and the compile-time configuration."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelConfig:
    """Tunable compile-time parameters of a span kernel launch."""

    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_k", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.block_k & (self.block_k - 1) or not 1 <= self.block_k <= 1024:
            raise ValueError(f"block_k must be a power of two in [1, 1024], got {self.block_k}")
        if self.num_warps & (self.num_warps - 1) or self.num_warps > 32:
            raise ValueError(f"num_warps must be a power of two <= 32, got {self.num_warps}")


@dataclass(frozen=True)
class LaunchGeometry:
    """Span-attention inputs laid out the way the kernels read them.

    q [B, Hq, Lq, D], k and v [B, Hkv, Lkv, D] with a unit stride on D and equal strides;
    qstart/qend contiguous [B, Hq, Lq, K]; cache_position int32 [Lq]; mask uint8 [B, >= Lkv]
    with a unit column stride (a 1-element dummy when there is no mask).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qstart: torch.Tensor
    qend: torch.Tensor
    cache_position: torch.Tensor
    mask: torch.Tensor
    has_mask: bool
    window: int

    @property
    def rep(self) -> int:
        """Query heads per key/value head."""
        return self.q.shape[1] // self.k.shape[1]

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """The uint8 mask, or None when there is none."""
        return self.mask if self.has_mask else None

    @property
    def mask_stride(self) -> int:
        """Row stride of the mask (0 without a mask)."""
        return self.mask.stride(0) if self.has_mask else 0

    @classmethod
    def prepare(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        qstart: torch.Tensor,
        qend: torch.Tensor,
        cache_position: torch.Tensor,
        attention_mask: torch.Tensor | None,
        window: int,
    ) -> "LaunchGeometry":
        """Lay validated inputs out for the kernels, copying only what is not already usable."""
        q = q if q.stride(-1) == 1 else q.contiguous()
        if k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride() != v.stride():
            k, v = k.contiguous(), v.contiguous()
        if attention_mask is None:
            mask = torch.zeros(1, dtype=torch.uint8, device=q.device)
        elif attention_mask.dtype == torch.bool and attention_mask.stride(-1) == 1:
            mask = attention_mask.view(torch.uint8)
        else:
            mask = (attention_mask != 0).to(torch.uint8)
        return cls(
            q=q,
            k=k,
            v=v,
            qstart=qstart.contiguous(),
            qend=qend.contiguous(),
            cache_position=cache_position.to(torch.int32).contiguous(),
            mask=mask,
            has_mask=attention_mask is not None,
            window=int(window),
        )
