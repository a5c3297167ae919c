"""The decode lower bound's cost model against the oracle's own choices, counted key by key."""

from __future__ import annotations

import oracle
import pytest
import torch

from superlinear_ops.ops.span_attention.reference import attended_counts, attended_keys
from superlinear_ops.problem import device_identity
from superlinear_ops.registry import REGISTRY
from superlinear_ops.tuner.runner import make_inputs
from superlinear_ops.tuner.workload import load

CPU = torch.device("cpu")
WORKLOAD = """\
name: traffic
model: {batch: 1, q_heads: 8, kv_heads: 2, head_dim: 16, dtype: float32}
span: {sw_index: 3, inv_search_power_int: 2, span_power: 0.5, backward_factor: 2.0, forward_factor: 1.0, topk: 3}
problems:
  - decode: {context: 12}
  - decode: {context: 400, batch: 2}
  - decode: {context: 400, batch: 2, mask: [holes, left_padding]}
"""


def counted_by_hand(case, x) -> tuple[float, float]:
    """(bytes, FLOPs) of an ideal step from the oracle's chosen spans, each key looked at in Python."""
    p = case.problem
    bf, ff, sp = p.factors
    power = oracle.Power.of(inv_search_power_int=2)
    _, traces = oracle.staged_decode(x.q1, x.q, x.k, x.v, x.cache_position, x.mask,
                                     oracle.DecodeParams(p.sw_index, p.spans, bf, ff, sp, power))
    batch, heads, kv_heads, keys, dim = p.batch, p.q_heads, p.kv_heads, x.k.shape[2], p.head_dim
    pos = min(int(x.cache_position[-1]), keys - 1)
    window_start = max(pos - p.window + 1, 0)
    window = set(range(window_start, pos + 1))
    scored = {pos + 1 - off for off in oracle.stripe_offsets(keys, p.sw_index, power)} & set(range(window_start))
    rows = touched = flops = 0
    for b in range(batch):
        kept = [True] * keys if x.mask is None else (x.mask[b] != 0).tolist()
        row_keys = set(scored)
        for g in range(kv_heads):
            attended = set(window)
            for h in range(g * heads // kv_heads, (g + 1) * heads // kv_heads):
                spans = [set(range(start, end + 1)) for _, _, start, end in traces[b, h].chosen]
                attended = attended.union(*spans)
                per_span = [sum(kept[k] for k in span | window) for span in spans] or [sum(kept[k] for k in window)]
                flops += 4 * dim * sum(per_span)
            rows += sum(kept[k] for k in attended | scored) + sum(kept[k] for k in attended)  # K rows, V rows
            row_keys |= attended
        touched += len(row_keys)
    mask_bytes = touched if x.mask is not None else 0
    return float((rows * dim + 3 * batch * heads * dim) * x.k.element_size() + mask_bytes), float(flops)


@pytest.mark.parametrize("label", ["decode 12", "decode 400, B=2", "decode 400, B=2, mask holes/left_padding"])
def test_decode_traffic_counts_each_key_of_a_group_once(tmp_path, label) -> None:
    """Short prefix, batch rows with heads choosing overlapping spans, holes and left padding: the
    model's bytes and FLOPs equal the hand count (each head's spans counted apart, or the scored
    stripes missed, would differ)."""
    path = tmp_path / "traffic.yaml"
    path.write_text(WORKLOAD)
    case = next(c for c in load(path).cases(device_identity(CPU)) if c.label == label)
    spec = REGISTRY.spec(case.problem.op)
    x = make_inputs(case, CPU, seed=3)
    timed = [x, *spec.variations(case, x, torch.Generator().manual_seed(4), timed=True)]
    assert len(timed) == (2 if "mask" in label else 1)
    for inputs in timed:
        assert spec.traffic(case, [inputs]) == counted_by_hand(case, inputs)


def test_attended_counts_sum_the_attended_keys() -> None:
    """Per (b, h, q, span) counts against the boolean map, with a mask, empty spans, spans reaching
    into the window and past the keys."""
    gen = torch.Generator().manual_seed(5)
    batch, heads, queries, slots, keys, window = 2, 3, 5, 4, 40, 6
    qstart = torch.randint(-2, keys + 2, (batch, heads, queries, slots), generator=gen)
    qend = qstart + torch.randint(-3, 20, qstart.shape, generator=gen)
    positions = torch.tensor([3, 9, 20, 38, 45])
    mask = torch.rand(batch, keys + 3, generator=gen) > 0.2
    for m in (None, mask):
        expected = attended_keys(qstart, qend, positions, m, keys, window).sum(-1)
        assert torch.equal(attended_counts(qstart, qend, positions, m, keys, window), expected)
    assert torch.equal(attended_counts(qstart, qend, positions, None, keys, 0),
                       attended_keys(qstart, qend, positions, None, keys, 0).sum(-1))
