"""Pure-PyTorch span attention: the test oracle and the CPU path of the public API.

Any floating dtype (float64 included) on any device. ``span_forward_reference`` is differentiable
with autograd; ``span_backward_reference`` computes the same gradients analytically (so it also
runs inside the ``span_backward`` custom op, where autograd is off). ``decode_reference`` is
written straight from docs/semantics.md section 3 with Python loops, so it shares no code with the graph-safe
decode it checks.

Non-finite values follow dense attention over the attended keys only: a NaN/Inf in Q, or in an
attended key's K, makes that span output NaN, a non-finite value of an attended key's V shows in
the output (NaN, or +-inf where only one infinite sign meets), and nothing held at a key that is
not attended (an uninitialised static-cache tail, a masked or out-of-span key) reaches any output
or gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ... import geometry


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class SpanSegments(NamedTuple):
    """Per (b, h, q, span), broadcastable to [B, H, Lq, K]: the span segment [lo, hi] and the window
    segment [window_lo, pos] of semantics section 2 (a segment is empty where its end precedes its start)."""

    lo: torch.Tensor
    hi: torch.Tensor
    window_lo: torch.Tensor
    pos: torch.Tensor

    def allowed(self, keys: torch.Tensor) -> torch.Tensor:
        """Boolean [..., len(keys)]: which of ``keys`` each row's segments hold (the mask not applied)."""
        in_span = (keys >= self.lo[..., None]) & (keys <= self.hi[..., None])
        return in_span | ((keys >= self.window_lo[..., None]) & (keys <= self.pos[..., None]))


def span_segments(qstart: torch.Tensor, qend: torch.Tensor, cache_position: torch.Tensor, key_length: int,
                  window: int) -> SpanSegments:
    """The segments of every (b, h, q, span), the span clamped to end before its query's window as
    every kernel clamps it (``span_tiles.clamped_span_bounds``): [max(qstart, 0), min(qend,
    Lkv - 1, pos - W)], the last bound only when W > 0, so overlapping (unvalidated) inputs give the
    same result on every path."""
    pos = cache_position.to(device=qstart.device, dtype=torch.int64).clamp(max=key_length - 1).view(1, 1, -1, 1)
    hi = qend.to(torch.int64).clamp(max=key_length - 1)  # a negative qend leaves the span empty
    if window > 0:
        hi = torch.minimum(hi, pos - window)
    window_lo = (pos - window + 1).clamp(min=0) if window > 0 else pos + 1
    return SpanSegments(qstart.to(torch.int64).clamp(min=0), hi, window_lo, pos)


def attended_keys(
    qstart: torch.Tensor,
    qend: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    key_length: int,
    window: int,
) -> torch.Tensor:
    """Boolean [B, H, Lq, K, Lkv]: which keys each (b, h, q, span) attends (semantics section 2, ``span_segments``)."""
    allowed = span_segments(qstart, qend, cache_position, key_length, window).allowed(torch.arange(key_length, device=qstart.device))
    if attention_mask is not None:
        allowed = allowed & (attention_mask[:, :key_length] != 0).view(-1, 1, 1, 1, key_length)
    return allowed


def attended_counts(
    qstart: torch.Tensor,
    qend: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    key_length: int,
    window: int,
) -> torch.Tensor:
    """int64 [B, H, Lq, K]: how many keys each (b, h, q, span) attends, the ``attended_keys`` sum
    computed from prefix counts of the mask (no [.., Lkv] tensor is built)."""
    seg = span_segments(qstart, qend, cache_position, key_length, window)
    batch = qstart.shape[0]
    kept = (torch.ones(batch, key_length, dtype=torch.int64, device=qstart.device) if attention_mask is None
            else (attention_mask[:, :key_length] != 0).to(torch.int64))
    before = torch.nn.functional.pad(kept.cumsum(-1), (1, 0))  # kept keys before each index, [B, Lkv + 1]

    def kept_in(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """Kept keys of [lo, hi] (inclusive; none where hi < lo) for lo, hi [B or 1, H or 1, Lq, K or 1]."""
        lo, hi = (t.expand(batch, *t.shape[1:]) for t in torch.broadcast_tensors(lo, hi))
        rows = before[:, None, None, :].expand(*lo.shape[:-1], key_length + 1)
        count = rows.gather(-1, (hi + 1).clamp(0, key_length)) - rows.gather(-1, lo.clamp(0, key_length))
        return torch.where(hi >= lo, count, 0)

    return kept_in(seg.lo, seg.hi) + kept_in(seg.window_lo, seg.pos)


def _finite_or_zero(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def _value_poison(nan_n: torch.Tensor, pos_n: torch.Tensor, neg_n: torch.Tensor) -> torch.Tensor:
    """What non-finite V entries at attended keys add to an output, from their counts per (row, d):
    NaN, or the one sign's infinity (+inf + -inf is NaN already), else 0."""
    poison = torch.where(pos_n > 0, math.inf, 0.0) + torch.where(neg_n > 0, -math.inf, 0.0)
    return torch.where(nan_n > 0, math.nan, poison)


@dataclass
class _Softmax:
    """The masked softmax of a span forward on finite (cleaned) operands."""

    q: torch.Tensor  # [B, Hq, Lq, D], non-finite entries zeroed
    k: torch.Tensor  # [B, Hq, Lkv, D] (kv heads repeated), non-finite entries zeroed
    v: torch.Tensor  # [B, Hq, Lkv, D] likewise
    probs: torch.Tensor  # [B, Hq, Lq, K, Lkv], 0 at keys not attended
    log_total: torch.Tensor  # [B, Hq, Lq, K, 1] natural-log sum of exp (-inf: no key attended)
    poisoned: torch.Tensor  # [B, Hq, Lq, K] bool: a non-finite Q or attended K makes the row NaN
    v_poison: torch.Tensor  # [B, Hq, Lq, K, D] 0, or the non-finite value attended V entries add


def _softmax(q, k, v, qstart, qend, cache_position, attention_mask, window) -> _Softmax:
    dim, rep = q.shape[-1], q.shape[1] // k.shape[1]
    cdt = _compute_dtype(q.dtype)
    q, kr, vr = q.to(cdt), k.to(cdt).repeat_interleave(rep, dim=1), v.to(cdt).repeat_interleave(rep, dim=1)
    allowed = attended_keys(qstart, qend, cache_position, attention_mask, k.shape[2], window)
    any_key = allowed.any(dim=-1)
    bad_key = ~torch.isfinite(kr).all(dim=-1)[:, :, None, None, :]  # [B, H, 1, 1, Lkv]
    bad_query = ~torch.isfinite(q).all(dim=-1)[..., None]  # [B, H, Lq, 1]
    poisoned = (allowed & bad_key).any(dim=-1) | (bad_query & any_key)
    # Non-finite V entries at attended keys, counted per (row, d) with exact 0/1 sums.
    weights = allowed.to(cdt)
    nan_n = torch.einsum("bhqkl,bhld->bhqkd", weights, torch.isnan(vr).to(cdt))
    pos_n = torch.einsum("bhqkl,bhld->bhqkd", weights, (vr == math.inf).to(cdt))
    neg_n = torch.einsum("bhqkl,bhld->bhqkd", weights, (vr == -math.inf).to(cdt))
    v_poison = _value_poison(nan_n, pos_n, neg_n).to(cdt)
    q, kr, vr = _finite_or_zero(q), _finite_or_zero(kr), _finite_or_zero(vr)
    scores = torch.matmul(q, kr.transpose(-1, -2)) / math.sqrt(dim)  # [B, H, Lq, Lkv]
    scores = scores[:, :, :, None, :].expand(-1, -1, -1, qstart.shape[-1], -1)
    masked = scores.masked_fill(~allowed, float("-inf"))
    row_max = masked.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    unnormalised = torch.exp(masked - row_max)  # exactly 0 where not attended
    total = unnormalised.sum(dim=-1, keepdim=True)
    probs = unnormalised / torch.where(total > 0, total, torch.ones_like(total))
    log_total = torch.where(total > 0, row_max + torch.log(total), -math.inf)
    return _Softmax(q, kr, vr, probs, log_total, poisoned, v_poison)


KEY_BLOCK = 1 << 16  # keys a forward step reads at once
SCORE_BLOCK = 1 << 24  # scores a forward step holds at once (rows x spans x keys)


def _rows_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: SpanSegments, keep: torch.Tensor | None,
                  block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [R, K, D], natural-log sum of exp [R, K] (-inf: no key), poisoned [R, K]) for the queries
    q [R, D] (compute dtype) of one KV group with their spans' ``segments`` [R, K], by an online
    softmax over blocks of ``block`` keys of k, v [Lkv, D] (converted a block at a time); ``keep``
    [Lkv] the mask row. Every block is visited (no host read decides which)."""
    rows, slots, dim = q.shape[0], segments.lo.shape[1], q.shape[1]
    scores_q = _finite_or_zero(q)
    row_max = q.new_full((rows, slots), -math.inf)
    total, attended, bad_keys = (q.new_zeros(rows, slots) for _ in range(3))
    acc, v_hits = q.new_zeros(rows, slots, dim), q.new_zeros(rows, slots, 3 * dim)
    for first in range(0, k.shape[0], block):
        end = min(first + block, k.shape[0])
        kb, vb = k[first:end].to(q.dtype), v[first:end].to(q.dtype)
        allowed = segments.allowed(torch.arange(first, end, device=q.device))  # [R, K, N]
        if keep is not None:
            allowed = allowed & keep[first:end]
        weights = allowed.to(q.dtype)
        attended = attended + weights.sum(dim=-1)
        bad_keys = bad_keys + weights @ (~torch.isfinite(kb).all(dim=-1)).to(q.dtype)
        v_hits = v_hits + weights @ torch.cat([torch.isnan(vb), vb == math.inf, vb == -math.inf], dim=-1).to(q.dtype)
        scores = scores_q @ _finite_or_zero(kb).T / math.sqrt(dim)  # [R, N], shared by the K spans
        scores = torch.where(allowed, scores[:, None, :], -math.inf)
        new_max = torch.maximum(row_max, scores.amax(dim=-1).detach())
        shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        unnormalised = torch.exp(scores - shift[..., None])  # exactly 0 where not attended
        rescale = torch.exp(row_max - shift)  # what the blocks before weigh now (0 before any key)
        total = total * rescale + unnormalised.sum(dim=-1)
        acc = acc * rescale[..., None] + unnormalised @ _finite_or_zero(vb)
        row_max = new_max
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    out = acc / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    out = out + _value_poison(*v_hits.split(dim, dim=-1)).to(out.dtype)
    bad_query = ~torch.isfinite(q).all(dim=-1)[:, None]
    poisoned = (bad_keys > 0) | (bad_query & (attended > 0))
    return out, torch.where(total > 0, shift + torch.log(total), -math.inf), poisoned


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
    (fp32, +inf where no key is attended, NaN where the output is poisoned), as the Triton
    forward writes it. Computed per KV group by an online softmax over blocks of keys, converted to
    the compute dtype a block at a time, for chunks of the group's queries: memory grows with the
    rows and one block of keys, never with Lkv x query heads (nor is any key copied whole).
    """
    batch, hq, lq, dim = q.shape
    hkv, key_length, slots = k.shape[1], k.shape[2], qstart.shape[-1]
    rep = hq // hkv
    segments = span_segments(qstart, qend, cache_position, key_length, window)
    segments = SpanSegments(*(t.expand(batch, hq, lq, slots) for t in segments))
    keep = None if attention_mask is None else attention_mask[:, :key_length] != 0
    cdt = _compute_dtype(q.dtype)
    block = max(1, min(KEY_BLOCK, key_length))
    chunk = max(1, SCORE_BLOCK // (block * max(slots, 1)))  # queries per step
    outs, lses = [], []
    for b in range(batch):
        for g in range(hkv):
            heads = slice(g * rep, (g + 1) * rep)
            queries = q[b, heads].reshape(rep * lq, dim).to(cdt)
            group = SpanSegments(*(t[b, heads].reshape(rep * lq, slots) for t in segments))
            for rows in (slice(i, i + chunk) for i in range(0, rep * lq, chunk)):
                out, log_total, poisoned = _rows_forward(queries[rows], k[b, g], v[b, g], SpanSegments(*(t[rows] for t in group)),
                                                         None if keep is None else keep[b], block)
                outs.append(torch.where(poisoned[..., None], math.nan, out))
                lse = torch.where(torch.isfinite(log_total), log_total / math.log(2.0), math.inf)
                lses.append(torch.where(poisoned, math.nan, lse))
    out = torch.cat(outs).view(batch, hq, lq, slots, dim).to(q.dtype) if outs else q.new_zeros(batch, hq, lq, slots, dim)
    if not return_lse:
        return out
    lse = torch.cat(lses).view(batch, hq, lq, slots) if lses else q.new_full((batch, hq, lq, slots), math.inf)
    return out, lse.detach().float()


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
    """(dQ, dK, dV) of ``span_forward_reference`` for ``grad_out``, computed analytically.

    No autograd (it runs inside the ``span_backward`` custom op): with P the attention weights,
    dV = P^T dO, dS = P (dO.V - rowsum(dO O)), dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D),
    dK/dV summed over the query heads of each kv head. Poisoned (NaN) outputs pass no gradient,
    as their ``torch.where`` does under autograd.
    """
    with torch.no_grad():
        batch, hq, _, dim = q.shape
        hkv, lkv = k.shape[1], k.shape[2]
        sm = _softmax(q, k, v, qstart, qend, cache_position, attention_mask, window)
        d_out = grad_out.to(sm.probs.dtype).masked_fill(sm.poisoned[..., None], 0.0)
        d_v = torch.einsum("bhqkl,bhqkd->bhld", sm.probs, d_out)
        d_p = torch.einsum("bhqkd,bhld->bhqkl", d_out, sm.v)
        d_s = sm.probs * (d_p - (sm.probs * d_p).sum(dim=-1, keepdim=True))
        d_s = d_s.sum(dim=3) / math.sqrt(dim)  # [B, Hq, Lq, Lkv]
        d_q = torch.matmul(d_s, sm.k)
        d_k = torch.matmul(d_s.transpose(-1, -2), sm.q)
        group = (batch, hkv, hq // hkv, lkv, dim)
        d_k, d_v = d_k.view(group).sum(dim=2), d_v.view(group).sum(dim=2)
        return d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype)


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
    """Staged decode [B, Hq, 1, D], computed literally from semantics section 3 in float64."""
    batch, hq, _, dim = q1.shape
    hkv, lkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    exponent = float(params.inv_int) if params.integer_path else params.inv_p
    window = geometry.window_length(sw_index, params)
    pos = min(int(cache_position[-1]), lkv - 1)
    t = pos + 1
    n_stripes = geometry.stripe_count(lkv, sw_index, params)
    kd, vd = k.double(), v.double()
    cdt = _compute_dtype(q1.dtype)  # search scores: fp32, float64 for float64 inputs
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
                    score = float(q1[b, h, 0].to(cdt).cpu() @ k[b, h // rep, loc].to(cdt).cpu())
                    candidates.append((math.inf if math.isnan(score) else score, loc))  # NaN wins: gate NaN
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
