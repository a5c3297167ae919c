"""Pure-PyTorch span attention: the test oracle and the CPU path of the public API.

Any floating dtype (float64 included) on any device. ``span_forward_reference`` is differentiable
with autograd; ``decode_reference`` is written straight from SPEC section 3 with Python loops, so
it shares no code with the graph-safe decode it checks.
"""

from __future__ import annotations

import math

import torch

from . import geometry


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def attended_keys(
    qstart: torch.Tensor,
    qend: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    key_length: int,
    window: int,
) -> torch.Tensor:
    """Boolean [B, H, Lq, K, Lkv]: which keys each (b, h, q, span) attends (SPEC section 2)."""
    keys = torch.arange(key_length, device=qstart.device)
    lo = qstart.clamp(min=0)[..., None]
    hi = qend.clamp(max=key_length - 1)[..., None]
    in_span = (keys >= lo) & (keys <= hi) & (qend[..., None] >= 0)
    pos = cache_position.to(device=qstart.device, dtype=torch.int64).clamp(max=key_length - 1)
    pos = pos.view(1, 1, -1, 1, 1)
    in_window = (keys >= (pos - window + 1).clamp(min=0)) & (keys <= pos) & (window > 0)
    allowed = in_span | in_window
    if attention_mask is not None:
        allowed = allowed & (attention_mask[:, :key_length] != 0).view(-1, 1, 1, 1, key_length)
    return allowed


def span_forward_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qstart: torch.Tensor,
    qend: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    window: int,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-span outputs [B, Hq, Lq, K, D] in q's dtype; zeros where no key is attended.

    With ``return_lse`` also the log2-domain log-sum-exp of the scaled scores [B, Hq, Lq, K]
    (fp32, +inf where no key is attended), as the Triton forward writes it.
    """
    batch, hq, lq, dim = q.shape
    hkv, lkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    cdt = _compute_dtype(q.dtype)
    kr = k.to(cdt).repeat_interleave(rep, dim=1)
    vr = v.to(cdt).repeat_interleave(rep, dim=1)
    scores = torch.matmul(q.to(cdt), kr.transpose(-1, -2)) / math.sqrt(dim)  # [B, H, Lq, Lkv]
    allowed = attended_keys(qstart, qend, cache_position, attention_mask, lkv, window)
    scores = scores[:, :, :, None, :].expand(-1, -1, -1, qstart.shape[-1], -1)
    masked = scores.masked_fill(~allowed, float("-inf"))
    row_max = masked.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    weights = torch.exp(masked - row_max) * allowed
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(total > 0, total, torch.ones_like(total))
    out = torch.einsum("bhqkl,bhld->bhqkd", probs, vr).to(q.dtype)
    if not return_lse:
        return out
    lse = torch.where(total > 0, (row_max + torch.log(total)) / math.log(2.0), math.inf)
    return out, lse.squeeze(-1).detach().float()


def span_backward_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qstart: torch.Tensor,
    qend: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    window: int,
    grad_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of ``span_forward_reference`` for ``grad_out``, by autograd on a recomputation."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = span_forward_reference(*leaves, qstart, qend, cache_position, attention_mask, window)
        return torch.autograd.grad(out, leaves, grad_out.to(out.dtype))


def _exact_ceil(factor: float, base: int, span_power: float) -> int:
    return geometry.ceil_scaled_power(factor, base, span_power) if base > 0 else 0


def decode_reference(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    sw_index: int,
    topk: int,
    backward_factor: float,
    forward_factor: float,
    span_power: float,
    params: geometry.PowerParams,
) -> torch.Tensor:
    """Staged decode [B, Hq, 1, D], computed literally from SPEC section 3 in float64."""
    batch, hq, _, dim = q1.shape
    hkv, lkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    exponent = float(params.inv_int) if params.integer_path else params.inv_p
    window = geometry.window_length(sw_index, params)
    pos = min(int(cache_position[-1]), lkv - 1)
    t = pos + 1
    n_stripes = geometry.stripe_count(lkv, sw_index, params)
    kd, vd = k.double(), v.double()
    mask = None if attention_mask is None else (attention_mask[:, :lkv] != 0).cpu()
    out = torch.zeros(batch, hq, 1, dim, dtype=torch.float64)

    def attend(b: int, h: int, keys: list[int]) -> torch.Tensor:
        keys = [x for x in keys if mask is None or bool(mask[b, x])]
        if not keys:
            return torch.zeros(dim, dtype=torch.float64)
        idx = torch.tensor(keys)
        kk, vv = kd[b, h // rep, idx].cpu(), vd[b, h // rep, idx].cpu()
        logits = kk @ q2[b, h, 0].double().cpu() / math.sqrt(dim)
        return torch.softmax(logits, dim=0) @ vv

    for b in range(batch):
        allowed = [x for x in range(lkv) if mask is None or bool(mask[b, x])]
        first_allowed = allowed[0] if allowed else 0
        for h in range(hq):
            if t <= window:
                out[b, h, 0] = attend(b, h, list(range(0, pos + 1)))
                continue
            window_keys = list(range(max(pos - window + 1, 0), pos + 1)) if window > 0 else []
            candidates = []
            for i in range(sw_index + 1, n_stripes + 1):
                loc = t - int(geometry.floor_powers([i], exponent)[0])
                if 0 <= loc < max(pos - window + 1, 0) and (mask is None or bool(mask[b, loc])):
                    score = float(q1[b, h, 0].float().cpu() @ k[b, h // rep, loc].float().cpu())
                    candidates.append((score, loc))
            candidates.sort(key=lambda c: -c[0])
            chosen = candidates[:topk]
            if not chosen:
                out[b, h, 0] = attend(b, h, window_keys)  # every g_j = 1/topk over equal outputs
                continue
            span_outs = []
            for _, anchor in chosen:
                start = max(anchor - _exact_ceil(backward_factor, t, span_power), 0)
                if forward_factor == 0.0:
                    end = anchor
                else:
                    end = anchor + _exact_ceil(forward_factor, max(t - first_allowed, 0), span_power)
                    end = min(end, pos, lkv - 1, *([pos - window] if window > 0 else []))
                span_outs.append(attend(b, h, list(range(start, end + 1)) + window_keys))
            # Missing slots (fewer valid stripes than topk) have score -inf: gate weight 0.
            gates = torch.softmax(torch.tensor([c[0] for c in chosen], dtype=torch.float64), dim=0)
            out[b, h, 0] = sum(g * o for g, o in zip(gates, span_outs))
    return out.to(q2.dtype).to(q2.device)
