"""Test cases and their input makers: each case asserts the properties its name claims (long spans,
multi-block windows, mask holes, unused slots, t <= W, strided inputs) so a change of the makers
cannot hollow a test."""

from __future__ import annotations

from dataclasses import dataclass

import oracle
import torch
from helpers import BLOCK_K, DecodeInputs, SpanInputs, random_heads

INT2 = oracle.Power.of(inv_search_power_int=2)
FLOAT55 = oracle.Power.of(search_power=0.55)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


# --- span forward / backward ------------------------------------------------------------------


@dataclass(frozen=True)
class SpanCase:
    dtype: str
    rep: int
    layout: str = "contiguous"  # of Q, K and V (see helpers.laid_out)
    power: oracle.Power = INT2
    sw_index: int = 5  # W = 35 (int2) or 33 (float 0.55 at sw_index 6): > 2 blocks of 16
    masked: bool = True
    batch: int = 1
    hkv: int = 1
    lkv: int = 160
    dim: int = 16
    spans: int = 2
    queries: int = 3  # t <= W, [deep in the keys, ...], past the last key

    @property
    def name(self) -> str:
        mask = "mask" if self.masked else "nomask"
        return f"{self.dtype}-rep{self.rep}-{self.layout}-{'int2' if self.power.inv_int else 'p0.55'}-W{self.window}-{mask}-D{self.dim}"

    @property
    def window(self) -> int:
        return oracle.window_length(self.sw_index, self.power)


SPAN_CASES = [  # each dtype with each GQA ratio; Triton's interpreter is slow: few programs each
    SpanCase("fp32", 1, hkv=2),
    SpanCase("fp32", 2, "transposed", FLOAT55, sw_index=6),
    SpanCase("fp32", 4, "strided", masked=False, dim=24, hkv=2),
    SpanCase("fp32", 16, power=FLOAT55, sw_index=6, queries=2, spans=1),
    SpanCase("bf16", 1, "expanded", FLOAT55, sw_index=6, batch=2),
    SpanCase("bf16", 2, "strided", hkv=2),
    SpanCase("bf16", 4, "transposed"),
    SpanCase("bf16", 16, masked=False, queries=2, spans=1),
    SpanCase("fp16", 1, "strided", hkv=2),
    SpanCase("fp16", 2, "expanded", FLOAT55, sw_index=6, batch=2),
    SpanCase("fp16", 4, dim=24),
    SpanCase("fp16", 16, "transposed", FLOAT55, sw_index=6, queries=2, spans=1),
    SpanCase("fp32", 2, sw_index=0),  # no window: spans alone
    SpanCase("fp64", 2, "transposed"),  # the reference variants' own dtype
]


def make_span_inputs(case: SpanCase, gen: torch.Generator) -> SpanInputs:
    """Queries at t <= W, deep in the keys and past the last key; slot 0 a span of more than two
    blocks, slot 1 random or unused; a mask with holes everywhere (25% of keys)."""
    dtype, window, lkv = DTYPES[case.dtype], case.window, case.lkv
    hq = case.hkv * case.rep
    lq = case.queries
    q = random_heads(gen, (case.batch, hq, lq, case.dim), dtype, case.layout)
    k, v = (random_heads(gen, (case.batch, case.hkv, lkv, case.dim), dtype, case.layout) for _ in range(2))
    early = int(torch.randint(2, max(window, 3), (1,), generator=gen))
    late = torch.randint(lkv // 2 + window, lkv, (lq - 2,), generator=gen).tolist()
    cache_position = torch.tensor([early, *late, lkv + 2])
    shape = (case.batch, hq, lq, case.spans)
    qstart, qend = torch.full(shape, -1), torch.full(shape, -1)
    for index in range(qstart.numel() // case.spans):
        b, h, i = index // (hq * lq), index // lq % hq, index % lq
        limit = min(int(cache_position[i]), lkv - 1) - window + 1 if window else min(int(cache_position[i]), lkv - 1) + 1
        for j in range(case.spans):
            if limit <= 0 or (j > 0 and torch.rand(1, generator=gen).item() < 0.25):
                continue
            shortest = 2 * BLOCK_K + 4 if j == 0 else 1
            length = int(torch.randint(min(shortest, limit), limit + 1, (1,), generator=gen))
            end = int(torch.randint(length - 1, limit, (1,), generator=gen))
            qstart[b, h, i, j], qend[b, h, i, j] = end - length + 1, end
    if case.spans > 1:  # at least one unused slot, besides those of t <= W
        qstart[0, 0, -1, -1] = qend[0, 0, -1, -1] = -1
    mask = torch.rand(case.batch, lkv + 3, generator=gen) > 0.25 if case.masked else None
    return SpanInputs(q, k, v, qstart, qend, cache_position, mask, case.sw_index, case.power)


def check_span_properties(case: SpanCase, x: SpanInputs) -> None:
    """The inputs have every property the case names."""
    window, lkv = x.window, case.lkv
    layouts = {"contiguous": x.q.is_contiguous(), "transposed": x.q.stride(1) < x.q.stride(2),
               "strided": x.q.stride(-1) == 2 and x.k.stride(2) == 4 * case.dim, "expanded": x.k.stride(0) == 0}
    assert layouts[case.layout], f"inputs are not {case.layout}"
    assert (x.qend == -1).any(), "no unused span slot"
    assert x.q.shape[1] // x.k.shape[1] == case.rep
    positions = x.cache_position.clamp(max=lkv - 1).tolist()
    assert window == 0 or window > 2 * BLOCK_K, "the window does not span several key blocks"
    assert window == 0 or min(positions) + 1 <= window, "no query with t <= W"
    assert max(x.cache_position.tolist()) >= lkv, "no query past the last key"
    allowed = (lambda b, key: True) if x.mask is None else (lambda b, key: bool(x.mask[b, key]))
    long_spans = attended = slots = span_holes = window_holes = 0
    for (b, h, i, j), start in zip(torch.cartesian_prod(*map(torch.arange, x.qstart.shape)).tolist(), x.qstart.flatten().tolist()):
        pos = positions[i]
        if window and pos + 1 <= window:
            continue
        slots += 1
        end = int(x.qend[b, h, i, j])
        span = [key for key in range(max(start, 0), end + 1)] if end >= 0 else []
        attended += any(allowed(b, key) for key in span)
        long_spans += len(span) > 2 * BLOCK_K
        span_holes += any(not allowed(b, key) for key in span)
        window_holes += any(not allowed(b, key) for key in range(max(pos - window + 1, 0), pos + 1))
    assert long_spans > 0, "no span longer than two key blocks"
    assert attended >= slots / 2, f"only {attended} of {slots} slots attend a span key"
    if x.mask is not None:
        assert span_holes and (window_holes or not window), "the mask has no hole inside a span or a window"


# --- staged decode ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeCase:
    dtype: str
    rep: int
    mask: str = "holes"  # none | holes (also at stripe locations; row 1 starts later) | static (keys after pos masked)
    layout: str = "contiguous"  # of Q1/Q2 (K, V: contiguous, or expanded with Q)
    power: oracle.Power = INT2
    sw_index: int = 5
    forward_factor: float = 1.0
    batch: int = 2
    hkv: int = 1
    lkv: int = 200
    pos: int = 190
    topk: int = 3
    dim: int = 16
    kind: str = "spans"  # spans | short-prefix (t <= W) | no-stripe (mask hides every stripe) | few-stripes

    @property
    def params(self) -> oracle.DecodeParams:
        return oracle.DecodeParams(self.sw_index, self.topk, 3.0, self.forward_factor, 0.5 if self.power.inv_int else 0.55,
                                   self.power)

    @property
    def name(self) -> str:
        power = "int2" if self.power.inv_int else "p0.55"
        return f"{self.dtype}-rep{self.rep}-{self.kind}-{self.mask}-{self.layout}-{power}-ff{self.forward_factor:g}"


DECODE_CASES = [
    DecodeCase("fp32", 1, hkv=2, sw_index=9, lkv=300, pos=290),  # W = 99: several 64-key window chunks
    DecodeCase("fp32", 2, "static", "transposed", FLOAT55, 6, lkv=256, pos=180),
    DecodeCase("fp32", 4, forward_factor=0.0, layout="strided"),
    DecodeCase("fp32", 16, "none", batch=1, power=FLOAT55, sw_index=6, topk=2),
    DecodeCase("bf16", 1, "static", hkv=2, lkv=256, pos=200, forward_factor=0.5),
    DecodeCase("bf16", 2, layout="transposed", power=FLOAT55, sw_index=6),
    DecodeCase("bf16", 4, forward_factor=0.0, layout="expanded"),
    DecodeCase("bf16", 16, batch=1, topk=2),
    DecodeCase("fp16", 1, "none", hkv=2, layout="strided"),
    DecodeCase("fp16", 2, power=FLOAT55, sw_index=6),
    DecodeCase("fp16", 4, "static", "expanded", lkv=256, pos=170),
    DecodeCase("fp16", 16, layout="transposed", batch=1, forward_factor=0.0, topk=2),
    DecodeCase("fp32", 2, "static", pos=20, kind="short-prefix"),
    DecodeCase("bf16", 2, kind="no-stripe"),
    DecodeCase("fp32", 2, lkv=48, pos=47, sw_index=2, topk=6, kind="few-stripes"),
    DecodeCase("fp64", 2, power=FLOAT55, sw_index=6),
]


def make_decode_inputs(case: DecodeCase, gen: torch.Generator) -> DecodeInputs:
    """Random Q1, Q2, K, V and a mask with holes everywhere, at half the valid stripe locations
    (chosen per row) and, for row 1, over its first 20 keys (its own first allowed key)."""
    dtype, hq, p = DTYPES[case.dtype], case.hkv * case.rep, case.params
    q1, q2 = (random_heads(gen, (case.batch, hq, 1, case.dim), dtype, case.layout) for _ in range(2))
    kv_layout = "expanded" if case.layout == "expanded" else "contiguous"
    k, v = (random_heads(gen, (case.batch, case.hkv, case.lkv, case.dim), dtype, kv_layout) for _ in range(2))
    cache_position = torch.arange(case.pos - 2, case.pos + 1)
    mask = None
    if case.mask != "none":
        mask = torch.rand(case.batch, case.lkv, generator=gen) > 0.2
        t, window_start = case.pos + 1, max(case.pos - p.window + 1, 0)
        locs = [t - o for o in oracle.stripe_offsets(case.lkv, p.sw_index, p.power) if 0 <= t - o < window_start]
        for b in range(case.batch):
            hidden = torch.randperm(len(locs), generator=gen)[: len(locs) // 2].tolist()
            mask[b, [locs[i] for i in hidden]] = False
            if case.kind == "no-stripe":
                mask[b, :window_start] = False
        if case.batch > 1:
            mask[1, :20] = False
        if case.mask == "static":
            mask[:, case.pos + 1 :] = False
    return DecodeInputs(q1, q2, k, v, cache_position, mask, p)


def check_decode_properties(case: DecodeCase, x: DecodeInputs, traces) -> None:
    """The inputs have every property the case names (from the oracle's decisions)."""
    p, pos = case.params, case.pos
    window = p.window
    assert window > 2 * BLOCK_K or case.kind == "few-stripes", "the window does not span several key blocks"
    chosen = [c for tr in traces.values() for c in tr.chosen]
    if case.kind == "short-prefix":
        assert pos + 1 <= window and all(tr.short_prefix for tr in traces.values())
        return
    if case.kind == "no-stripe":
        assert not chosen and not any(tr.short_prefix for tr in traces.values())
        return
    with_spans = sum(bool(tr.chosen) for tr in traces.values())
    assert with_spans >= len(traces) / 2, f"only {with_spans} of {len(traces)} heads chose a span"
    if case.kind == "few-stripes":
        assert any(len(tr.chosen) < case.topk for tr in traces.values()), "every head filled its top-k"
        return
    assert any(end - start + 1 > 2 * BLOCK_K for _, _, start, end in chosen), "no span longer than two blocks"
    if x.mask is None:
        return
    window_keys = range(pos - window + 1, pos + 1)
    assert not x.mask[:, window_keys].all(), "no hole inside the window"
    assert any(not x.mask[b, s : e + 1].all() for (b, _), tr in traces.items() for _, _, s, e in tr.chosen), "no hole inside a span"
    # Ignoring the mask at the stripes would change the choice of some head.
    t, rep = pos + 1, case.rep
    changed = 0
    for (b, h), tr in traces.items():
        masked = [t - o for o in oracle.stripe_offsets(case.lkv, p.sw_index, p.power)
                  if 0 <= t - o < pos - window + 1 and not x.mask[b, t - o]]
        scores = [float(x.q1[b, h, 0].double() @ x.k[b, h // rep, loc].double()) for loc in masked]
        changed += bool(scores) and (len(tr.chosen) < case.topk or max(scores) > tr.chosen[-1][0])
    assert changed, "no masked stripe would beat a chosen one: the mask at the stripes is untested"
