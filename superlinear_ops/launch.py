"""What every kernel launcher takes: the prepared tensors and the named compile-time configuration."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch


class KernelConfig(Mapping[str, int]):
    """A launch's compile-time parameters by name (each variant declares its own names and values).

    An immutable mapping of names to positive ints, e.g. ``KernelConfig(block_k=64, num_warps=4)``;
    parameters also read as attributes (``config.block_k``).
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, int] | None = None, /, **named: int) -> None:
        merged = {**(values or {}), **named}
        for name, value in merged.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"configuration parameter names must be identifiers, got {name!r}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "_values", dict(sorted(merged.items())))

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def __getattr__(self, name: str) -> int:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"this configuration has no parameter {name!r} (it has {sorted(self._values)})") from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("KernelConfig is immutable; use replace()")

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return hash(tuple(self._values.items()))

    def __repr__(self) -> str:
        return f"KernelConfig({', '.join(f'{k}={v}' for k, v in self._values.items())})"

    def __reduce__(self):
        return (KernelConfig, (self._values,))

    def replace(self, **changes: int) -> "KernelConfig":
        """A copy with ``changes`` applied."""
        return KernelConfig(self._values, **changes)

    def text(self) -> str:
        """'block_k=64 num_warps=4 ...' ('-' when empty)."""
        return " ".join(f"{k}={v}" for k, v in self._values.items()) or "-"


def check_block_k(block_k: int) -> int:
    """``block_k`` as a caller may force it: a power of two in [1, 1024]; ValueError otherwise."""
    if isinstance(block_k, bool) or not isinstance(block_k, int) or not 1 <= block_k <= 1024 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two in [1, 1024] (or None to let the library choose), got {block_k!r}")
    return block_k


def check_tile_config(config: Mapping[str, int], names: tuple[str, ...]) -> None:
    """ValueError unless ``config`` gives each tensor-core tunable in ``names`` a usable value: a
    positive int, a power of two except for stages, and at least 16 rows or keys per tile (the
    smallest tensor-core dot)."""
    for name in names:
        if name not in config:
            raise ValueError(f"config lacks {name!r}")
        value = config[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config[{name!r}] must be a positive int, got {value!r}")
        if not name.endswith("stages") and value & (value - 1):
            raise ValueError(f"config[{name!r}] must be a power of two, got {value}")
        if name.endswith(("block_m", "block_n")) and not 16 <= value <= 256:
            raise ValueError(f"config[{name!r}] must be in [16, 256] (tensor-core dots), got {value}")
        if name.endswith("warps") and value > 16:
            raise ValueError(f"config[{name!r}] must be at most 16, got {value}")


def forward_outputs(geo: "LaunchGeometry", out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``out``, or fresh forward buffers: per-span outputs [B, Hq, Lq, K, D] in Q's dtype and their
    log2-domain log-sum-exp [B, Hq, Lq, K] in fp32."""
    if out is not None:
        return out
    batch, hq, lq, dim = geo.q.shape
    n_spans = geo.qstart.shape[-1]
    return (
        torch.empty(batch, hq, lq, n_spans, dim, device=geo.q.device, dtype=geo.q.dtype),
        torch.empty(batch, hq, lq, n_spans, device=geo.q.device, dtype=torch.float32),
    )


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride on its last dimension (copied only when it has none)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def key_value_pair(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V with unit D strides and equal strides (one set of strides serves both)."""
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride() != v.stride():
        return k.contiguous(), v.contiguous()
    return k, v


def mask_bytes(attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The keep-mask as uint8 with a unit column stride (a bool mask is reinterpreted, not copied);
    a 1-element dummy that no kernel reads when there is no mask."""
    if attention_mask is None:
        return torch.zeros(1, dtype=torch.uint8, device=device)
    if attention_mask.dtype == torch.bool:
        return unit_stride(attention_mask).view(torch.uint8)
    return (attention_mask != 0).view(torch.uint8)  # one pass: the bool result reinterpreted


INT32_MAX = 2**31 - 1


def kernel_index(t: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """An index tensor with its values clamped to [low, high] where they could leave int32 (int64 input),
    so that the kernels' int32 arithmetic on them never wraps; int32 input is returned as it is."""
    return t if t.dtype == torch.int32 else t.clamp(low, high)


def check_kernel_extent(name: str, value: int) -> int:
    """``value`` when it fits the kernels' int32 index arithmetic; ValueError naming ``name`` otherwise."""
    if value > INT32_MAX:
        raise ValueError(f"{name} = {value} is too large for the kernels' int32 indices (at most {INT32_MAX})")
    return value


@functools.lru_cache(maxsize=None)
def hopper_or_newer(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of compute capability 9.0 or newer (TMA descriptors,
    programmatic dependent launch); asked once per device."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@dataclass(frozen=True)
class LaunchGeometry:
    """Span-attention inputs laid out the way the kernels read them.

    q [B, Hq, Lq, D], k and v [B, Hkv, Lkv, D] with a unit stride on D and equal strides;
    qstart/qend contiguous [B, Hq, Lq, K]; cache_position int32 [Lq]; mask uint8 [B, >= Lkv]
    with a unit column stride (a 1-element dummy when there is no mask); window W <= Lkv.

    This is the one place where the integers the kernels read are made to fit int32, each change
    exact: W is clamped to Lkv (a window at least as long as the keys covers every earlier key),
    span bounds to [-1, Lkv] (a start past the keys is an empty span, an end below -1 an unused
    slot) and positions to [-1, Lkv - 1] (SPEC: pos = min(cache_position, Lkv - 1)); int32 span
    bounds and positions are passed on as they are (the public ops clamp positions first:
    ``api.clamped_positions``; the kernels clamp them again, the window backward on the host).
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
        k, v = key_value_pair(k, v)
        key_length = check_kernel_extent("Lkv", k.shape[2])
        check_kernel_extent("Hq / Hkv * Lq * K (span triples per KV head)", q.shape[1] // k.shape[1] * qstart.shape[2] * qstart.shape[3])
        return cls(
            q=unit_stride(q),
            k=k,
            v=v,
            qstart=kernel_index(qstart, -1, key_length).contiguous(),
            qend=kernel_index(qend, -1, key_length).contiguous(),
            cache_position=kernel_index(cache_position, -1, key_length - 1).to(torch.int32).contiguous(),
            mask=mask_bytes(attention_mask, q.device),
            has_mask=attention_mask is not None,
            window=min(int(window), key_length),
        )
