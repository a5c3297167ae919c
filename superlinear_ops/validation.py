"""Input checks for the public ops: ValueError/TypeError naming the argument, never an assert.

``check_span_inputs`` and ``check_decode_inputs`` read only shapes, dtypes and devices (no device
synchronisation). ``check_span_contract`` reads tensor values, so it runs only when validation is
asked for (``validate=True`` or ``SUPERLINEAR_OPS_VALIDATE=1``).
"""

from __future__ import annotations

import os

import torch

MAX_HEAD_DIM = 256
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def validation_requested(validate: bool | None) -> bool:
    """True when the caller or SUPERLINEAR_OPS_VALIDATE asks for the checks that synchronise."""
    if validate is not None:
        return bool(validate)
    return os.environ.get("SUPERLINEAR_OPS_VALIDATE", "0").lower() in ("1", "true", "yes")


def _tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")


def _index(name: str, t: torch.Tensor) -> None:
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")


def _attention_tensors(q_name: str, q: object, k: object, v: object) -> tuple[int, int, int, int, int, int]:
    q, k, v = _tensor(q_name, q), _tensor("K", k), _tensor("V", v)
    _rank(q_name, q, 4, "[B, Hq, Lq, D]")
    _rank("K", k, 4, "[B, Hkv, Lkv, D]")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{q_name} must be float16, bfloat16, float32 or float64, got {q.dtype}")
    for name, t in (("K", k), ("V", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have {q_name}'s dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but {q_name} is on {q.device}")
    if v.shape != k.shape:
        raise ValueError(f"V must have K's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    batch, hq, lq, dim = q.shape
    _, hkv, lkv, kdim = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"K has batch {k.shape[0]} but {q_name} has batch {batch}")
    if kdim != dim:
        raise ValueError(f"K has head dim {kdim} but {q_name} has head dim {dim}")
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D must be in [1, {MAX_HEAD_DIM}], got {dim}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads Hq = {hq} must be a multiple of K's heads Hkv = {hkv}")
    if lkv == 0:
        raise ValueError("K and V must hold at least one key (Lkv >= 1)")
    return batch, hq, lq, dim, hkv, lkv


def check_mask_dtype(mask: torch.Tensor) -> None:
    """A keep-mask is bool or integer (nonzero = attend); floating (additive 0/-inf) masks are refused."""
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(
            f"attention_mask must be a bool or integer keep-mask (True/nonzero = the key may be attended), "
            f"got {mask.dtype}; convert an additive float mask (0 / -inf) with `mask == 0`"
        )


def _mask(attention_mask: object, batch: int, lkv: int, device: torch.device) -> None:
    if attention_mask is None:
        return
    mask = _tensor("attention_mask", attention_mask)
    check_mask_dtype(mask)
    _rank("attention_mask", mask, 2, "[B, >= Lkv]")
    if mask.shape[0] != batch or mask.shape[1] < lkv:
        raise ValueError(f"attention_mask must be [B={batch}, >= Lkv={lkv}], got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"attention_mask is on {mask.device} but the queries are on {device}")


def _cache_position(cache_position: object, length: int | None, device: torch.device) -> None:
    cp = _tensor("cache_position", cache_position)
    _rank("cache_position", cp, 1, "[Lq]")
    _index("cache_position", cp)
    if length is not None and cp.numel() != length:
        raise ValueError(f"cache_position must have Lq = {length} entries, got {cp.numel()}")
    if length is None and cp.numel() == 0:
        raise ValueError("cache_position must not be empty: its last entry is the decode position")
    if cp.device != device:
        raise ValueError(f"cache_position is on {cp.device} but the queries are on {device}")


def check_span_inputs(q, k, v, qstart, qend, cache_position, attention_mask) -> None:
    """Shape, dtype and device checks for the span-attention forward (no sync)."""
    batch, hq, lq, _, _, lkv = _attention_tensors("Q2", q, k, v)
    for name, t in (("qstart", qstart), ("qend", qend)):
        t = _tensor(name, t)
        _rank(name, t, 4, "[B, Hq, Lq, K]")
        _index(name, t)
        if tuple(t.shape[:3]) != (batch, hq, lq):
            raise ValueError(f"{name} must be [B={batch}, Hq={hq}, Lq={lq}, K], got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but Q2 is on {q.device}")
    if qstart.shape != qend.shape:
        raise ValueError(f"qend must have qstart's shape {tuple(qstart.shape)}, got {tuple(qend.shape)}")
    _cache_position(cache_position, lq, q.device)
    _mask(attention_mask, batch, lkv, q.device)


def check_anchor_inputs(anchors, cache_position, attention_mask, key_length: int) -> None:
    """Shape, dtype and device checks for the layer's spans from its anchors [B, Hq, Lq, topk]
    (no sync): one position per query, a mask row per batch row covering the keys."""
    anchors = _tensor("anchors", anchors)
    _rank("anchors", anchors, 4, "[B, Hq, Lq, topk]")
    _index("anchors", anchors)
    _cache_position(cache_position, anchors.shape[2], anchors.device)
    _mask(attention_mask, anchors.shape[0], key_length, anchors.device)


def check_topk(value: object, name: str = "topk") -> int:
    """``value`` as a slot count: an int >= 1; ValueError/TypeError naming ``name`` (the argument the caller passed)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _search_query(q1, q2, topk) -> None:
    """Checks of what searching ops add to the attention inputs: Q1 like Q2, and topk."""
    q1 = _tensor("Q1", q1)
    if q1.shape != q2.shape:
        raise ValueError(f"Q1 must have Q2's shape {tuple(q2.shape)}, got {tuple(q1.shape)}")
    if q1.dtype != q2.dtype or q1.device != q2.device:
        raise TypeError(f"Q1 must match Q2's dtype and device ({q2.dtype}, {q2.device})")
    check_topk(topk)


def check_decode_inputs(q1, q2, k, v, cache_position, attention_mask, topk) -> None:
    """Shape, dtype and device checks for staged decode (no sync)."""
    batch, hq, lq, dim, _, lkv = _attention_tensors("Q2", q2, k, v)
    _search_query(q1, q2, topk)
    if lq != 1:
        raise ValueError(f"staged decode takes one query (Lq = 1), got Lq = {lq}")
    _cache_position(cache_position, None, q2.device)
    _mask(attention_mask, batch, lkv, q2.device)


def check_layer_inputs(q1, q2, k, v, cache_position, attention_mask, topk) -> None:
    """Shape, dtype and device checks for the whole layer (no sync)."""
    batch, hq, lq, dim, _, lkv = _attention_tensors("Q2", q2, k, v)
    _search_query(q1, q2, topk)
    _cache_position(cache_position, lq, q2.device)
    _mask(attention_mask, batch, lkv, q2.device)


def check_span_contract(qstart, qend, cache_position, key_length: int, window: int) -> None:
    """Value checks (these synchronise): indices in range and spans ending before the window."""
    if bool((cache_position < 0).any()):
        raise ValueError("cache_position must be >= 0")
    for name, t in (("qstart", qstart), ("qend", qend)):
        if bool((t < -1).any()):
            raise ValueError(f"{name} must be >= -1 (-1 marks an unused span slot)")
        if bool((t >= key_length).any()):
            raise ValueError(f"{name} must be < Lkv = {key_length}")
    if window > 0:
        pos = cache_position.to(torch.int64).clamp(max=key_length - 1).view(1, 1, -1, 1)
        window_start = (pos - window + 1).clamp(min=0)
        used = qend >= 0
        if bool((used & (qend >= window_start)).any()):
            raise ValueError(
                f"a span ends inside the sliding window (window length {window}): spans must end "
                "before pos - W + 1"
            )


def requires_grad(*inputs: torch.Tensor) -> bool:
    """True when autograd records a call on ``inputs`` (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
