"""An independent oracle for every op, written from SPEC.md alone.

It shares no code with the package (no import of ``superlinear_ops``): geometry by brute force in
exact arithmetic (Python integers, 80-digit decimals), span attention and staged decode by loops in
float64. Slow by design; use tiny shapes. Spans are clamped to end before each query's window
(``hi = min(qend, Lkv - 1, pos - W)`` when W > 0), the semantics adopted for unvalidated inputs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext

import torch

_DIGITS = 80


# --- geometry ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Power:
    """The search power: ``inv_int`` = n on the integer path (0 on the float path), ``inv_p`` = 1/p."""

    inv_p: float
    inv_int: int

    @classmethod
    def of(cls, search_power: float | None = None, inv_search_power_int: int | None = None) -> Power:
        """From the API's pair of arguments (exactly one given)."""
        if (search_power is None) == (inv_search_power_int is None):
            raise ValueError("give exactly one of search_power, inv_search_power_int")
        if inv_search_power_int is not None:
            return cls(float(inv_search_power_int), int(inv_search_power_int))
        inv_p = 1.0 / search_power
        n = round(inv_p)
        return cls(inv_p, n if n in (2, 3, 4, 5, 6) and float(n) == inv_p else 0)

    def kwargs(self) -> dict:
        """The API's (search_power, inv_search_power_int) arguments."""
        if self.inv_int:
            return {"search_power": None, "inv_search_power_int": self.inv_int}
        return {"search_power": 1.0 / self.inv_p, "inv_search_power_int": None}


def _decimal_power(base: int, exponent: float) -> Decimal:
    with localcontext() as ctx:
        ctx.prec = _DIGITS
        return Decimal(base) ** Decimal(exponent)


@functools.cache
def floor_power(i: int, power: Power) -> int:
    """floor(i ** inv_p), exactly."""
    if power.inv_int:
        return i**power.inv_int
    if i == 0:
        return 0
    return int(_decimal_power(i, power.inv_p).to_integral_value(rounding=ROUND_FLOOR))


def ceil_scaled(factor: float, base: int, exponent: float) -> int:
    """ceil(factor * base ** exponent), exactly (0 for base 0)."""
    if base <= 0:
        return 0
    with localcontext() as ctx:
        ctx.prec = _DIGITS
        return int((Decimal(factor) * _decimal_power(base, exponent)).to_integral_value(rounding=ROUND_CEILING))


def window_length(sw_index: int, power: Power) -> int:
    """W = floor((sw_index + 1) ** inv_p) - 1."""
    return floor_power(sw_index + 1, power) - 1


def max_stripe_index(t: int, power: Power) -> int:
    """The largest i with floor(i ** inv_p) <= t, by searching the integers."""
    i = 0
    while floor_power(i + 1, power) <= t:
        i += 1
    return i


def stripe_count(key_length: int, sw_index: int, power: Power) -> int:
    """S = max(largest stripe index for Lkv, sw_index + 1)."""
    return max(max_stripe_index(key_length, power), sw_index + 1)


def stripe_offsets(key_length: int, sw_index: int, power: Power) -> list[int]:
    """floor(i ** inv_p) for the stripes i = sw_index + 1 .. S."""
    return [floor_power(i, power) for i in range(sw_index + 1, stripe_count(key_length, sw_index, power) + 1)]


# --- span attention ---------------------------------------------------------------------------


def attended_keys(qstart: int, qend: int, pos: int, key_length: int, window: int, allowed) -> list[int]:
    """Keys one (b, h, q, span) attends: span (clamped before the window) and window, mask applied."""
    pos = min(pos, key_length - 1)
    keys = set()
    hi = min(qend, key_length - 1, *([pos - window] if window > 0 else []))
    if qend >= 0:
        keys.update(range(max(qstart, 0), hi + 1))
    if window > 0:
        keys.update(range(max(pos - window + 1, 0), pos + 1))
    return sorted(x for x in keys if allowed(x))


def _row_allowed(mask: torch.Tensor | None, b: int):
    if mask is None:
        return lambda x: True
    row = [bool(x) for x in (mask[b] != 0).tolist()]
    return lambda x: row[x]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: list[int]) -> tuple[torch.Tensor, float]:
    """softmax(q.K^T / sqrt(D)) . V over ``keys``; zeros and lse +inf when there are none."""
    if not keys:
        return q.new_zeros(q.shape[-1]), math.inf
    idx = torch.tensor(keys)
    scores = k[idx] @ q / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, 0)
    return torch.softmax(scores, 0) @ v[idx], float(lse.detach()) / math.log(2.0)


def span_forward(q, k, v, qstart, qend, cache_position, mask, window: int):
    """Per-span outputs [B, Hq, Lq, K, D] and log2-domain lse [B, Hq, Lq, K], float64.

    Differentiable in q, k, v (pass float64 leaves that require grad); inputs of another dtype are
    converted exactly.
    """
    q, k, v = (t if t.dtype == torch.float64 else t.double() for t in (q, k, v))
    batch, hq, lq, _ = q.shape
    rep, key_length = hq // k.shape[1], k.shape[2]
    starts, ends, positions = qstart.tolist(), qend.tolist(), cache_position.tolist()
    outs, lses = [], []
    for b in range(batch):
        allowed = _row_allowed(mask, b)
        for h in range(hq):
            for i in range(lq):
                for j in range(qstart.shape[-1]):
                    keys = attended_keys(starts[b][h][i][j], ends[b][h][i][j], positions[i], key_length, window, allowed)
                    out, lse = _attend(q[b, h, i], k[b, h // rep], v[b, h // rep], keys)
                    outs.append(out)
                    lses.append(lse)
    shape = (batch, hq, lq, qstart.shape[-1])
    return torch.stack(outs).view(*shape, -1), torch.tensor(lses, dtype=torch.float64).view(shape)


def span_gradients(q, k, v, qstart, qend, cache_position, mask, window: int, grad_out: torch.Tensor):
    """(dQ, dK, dV) in float64 by autograd on the oracle forward."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, _ = span_forward(*leaves, qstart, qend, cache_position, mask, window)
    return torch.autograd.grad(out, leaves, grad_out.double())


# --- staged decode ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeParams:
    """The scalar arguments of a staged decode."""

    sw_index: int
    topk: int
    backward_factor: float
    forward_factor: float
    span_power: float
    power: Power

    @property
    def window(self) -> int:
        return window_length(self.sw_index, self.power)


@dataclass(frozen=True)
class DecodeTrace:
    """What the oracle decided for one (b, h): chosen (score, anchor, qstart, qend), best first."""

    short_prefix: bool
    chosen: list[tuple[float, int, int, int]]


def decode_head(q1, q2, k, v, pos: int, allowed, params: DecodeParams) -> tuple[torch.Tensor, DecodeTrace]:
    """Staged decode for one (b, h) (semantics section 3): q1/q2 [D], k/v [Lkv, D] of its KV head.

    Anchors are chosen on detached float64 scores; the output is differentiable in q1 (through the
    gate), q2, k and v, like the whole layer's.
    """
    key_length = k.shape[0]
    pos = min(pos, key_length - 1)
    t, window = pos + 1, params.window
    if t <= window:
        return _attend(q2, k, v, [x for x in range(pos + 1) if allowed(x)])[0], DecodeTrace(True, [])
    window_start = max(pos - window + 1, 0)
    window_keys = list(range(window_start, pos + 1)) if window > 0 else []
    candidates = []
    for offset in stripe_offsets(key_length, params.sw_index, params.power):
        loc = t - offset
        if 0 <= loc < window_start and allowed(loc):
            candidates.append((float(q1.detach() @ k[loc].detach()), loc))
    candidates.sort(key=lambda c: -c[0])
    first = next((x for x in range(key_length) if allowed(x)), 0)
    chosen, outs = [], []
    for score, anchor in candidates[: params.topk]:
        start = max(anchor - ceil_scaled(params.backward_factor, t, params.span_power), 0)
        end = anchor
        if params.forward_factor != 0.0:
            reach = ceil_scaled(params.forward_factor, max(t - first, 0), params.span_power)
            end = min(anchor + reach, pos, key_length - 1, *([pos - window] if window > 0 else []))
        chosen.append((score, anchor, start, end))
        keys = sorted(set(range(start, end + 1)) | set(window_keys))
        outs.append(_attend(q2, k, v, [x for x in keys if allowed(x)])[0])
    if not chosen:  # every gate weight 1/topk over equal window-only outputs
        return _attend(q2, k, v, [x for x in window_keys if allowed(x)])[0], DecodeTrace(False, [])
    # The gate scores are recomputed from the leaves, so that Q1 and K get their gradient through the gate.
    gate = torch.softmax(torch.stack([q1 @ k[anchor] for _, anchor, _, _ in chosen]), 0)
    return sum(g * o for g, o in zip(gate, outs)), DecodeTrace(False, chosen)


def staged_decode(q1, q2, k, v, cache_position, mask, params: DecodeParams):
    """Staged decode [B, Hq, 1, D] in float64 and the per-(b, h) traces."""
    q1, q2, k, v = (t.double() for t in (q1, q2, k, v))
    batch, hq = q1.shape[:2]
    rep = hq // k.shape[1]
    pos = int(cache_position[-1])
    out = torch.zeros(batch, hq, 1, q1.shape[-1], dtype=torch.float64)
    traces = {}
    for b in range(batch):
        allowed = _row_allowed(mask, b)
        for h in range(hq):
            g = h // rep
            out[b, h, 0], traces[b, h] = decode_head(q1[b, h, 0], q2[b, h, 0], k[b, g], v[b, g], pos, allowed, params)
    return out, traces


# --- the whole layer (prefill and training) ---------------------------------------------------

EMPTY_GATE_SCORE = -1e9  # the gate score of an empty slot (semantics section 4, step 4)


@dataclass(frozen=True)
class LayerTrace:
    """What the oracle decided for one (b, h, q) of the whole layer: its valid stripes as (score,
    stripe index i, key) best first (ties: larger i first), and the chosen (anchor, qstart, qend)."""

    t: int
    first_allowed: int
    short_prefix: bool
    candidates: list[tuple[float, int, int]]
    chosen: list[tuple[int, int, int]]

    @property
    def anchors(self) -> list[int]:
        return sorted(a for a, _, _ in self.chosen)


def layer_head(q1, q2, k, v, pos: int, allowed, params: DecodeParams) -> tuple[torch.Tensor, LayerTrace]:
    """The whole layer for one (b, h, q) (semantics section 4): q1/q2 [D], k/v [Lkv, D] of its KV head.

    Anchors are chosen on detached float64 scores (exact for inputs whose dot products are exact in
    fp32); the output is differentiable in q1 (through the gate), q2, k and v.
    """
    key_length = k.shape[0]
    pos = min(pos, key_length - 1)
    t, window = pos + 1, params.window
    first = next((x for x in range(key_length) if allowed(x)), 0)
    if t <= window:
        out = _attend(q2, k, v, [x for x in range(pos + 1) if allowed(x)])[0]
        return out, LayerTrace(t, first, True, [], [])
    candidates = []
    for i, offset in enumerate(stripe_offsets(key_length, params.sw_index, params.power), start=params.sw_index + 1):
        loc = t - offset
        if 0 <= loc < key_length and allowed(loc):
            candidates.append((float(q1.detach() @ k[loc].detach()), i, loc))
    candidates.sort(reverse=True)  # by score, then the larger stripe index first
    chosen = []
    for _, _, anchor in candidates[: params.topk]:
        start = max(anchor - ceil_scaled(params.backward_factor, t - first, params.span_power), first)
        end = anchor
        if params.forward_factor != 0.0:
            reach = ceil_scaled(params.forward_factor, t - first, params.span_power)
            end = min(anchor + reach, pos, key_length - 1, *([pos - window] if window > 0 else []))
        chosen.append((anchor, start, end))
    slots = chosen + [(-1, -1, -1)] * (params.topk - len(chosen))
    scores, outs = [], []
    for anchor, start, end in slots:
        scores.append(q1 @ k[anchor] if anchor >= 0 else q1.new_tensor(EMPTY_GATE_SCORE))
        outs.append(_attend(q2, k, v, attended_keys(start, end, pos, key_length, window, allowed))[0])
    gate = torch.softmax(torch.stack(scores), 0)
    return (gate[:, None] * torch.stack(outs)).sum(0), LayerTrace(t, first, False, candidates, chosen)


def attention_layer(q1, q2, k, v, cache_position, mask, params: DecodeParams):
    """The whole layer O [B, Hq, Lq, D] in float64 and the traces {(b, h, q): LayerTrace}.

    Differentiable in q1, q2, k, v (pass float64 leaves that require grad); inputs of another
    dtype are converted exactly.
    """
    q1, q2, k, v = (t if t.dtype == torch.float64 else t.double() for t in (q1, q2, k, v))
    batch, hq, lq, _ = q1.shape
    rep = hq // k.shape[1]
    positions = cache_position.tolist()
    outs, traces = [], {}
    for b in range(batch):
        allowed = _row_allowed(mask, b)
        for h in range(hq):
            g = h // rep
            for i in range(lq):
                out, traces[b, h, i] = layer_head(q1[b, h, i], q2[b, h, i], k[b, g], v[b, g], positions[i], allowed, params)
                outs.append(out)
    return torch.stack(outs).view(batch, hq, lq, -1), traces
