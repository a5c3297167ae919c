"""Every span kernel variant (Triton interpreter) against the float64 PyTorch reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import assert_close, random_spans

from superlinear_ops import geometry
from superlinear_ops.kernels.launch import KernelConfig, LaunchGeometry
from superlinear_ops.kernels.span_forward import span_forward
from superlinear_ops.reference import span_forward_reference
from superlinear_ops.registry import REGISTRY

TRITON_BACKWARD = [v for v in REGISTRY.variants("span_backward") if v.name != "reference"]


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    batch: int
    hq: int
    hkv: int
    lq: int
    lkv: int
    dim: int
    spans: int
    sw_index: int
    search_power: float | None  # None: integer path (inv_search_power_int=2)
    masked: bool
    block_k: int
    max_span: int

    @property
    def window(self) -> int:
        inv = None if self.search_power is not None else 2
        return geometry.window_len_from_sw_index(
            self.sw_index, search_power=self.search_power, inv_search_power_int=inv
        )


FORWARD_CASES = [
    # fp32, GQA rep 2, float power path, mask with holes, D not a power of two, long spans
    Case(torch.float32, 2, 4, 2, 4, 90, 24, 3, 3, 0.55, True, 16, 45),
    # bf16, MHA, integer path, no mask
    Case(torch.bfloat16, 1, 2, 2, 5, 70, 32, 2, 2, None, False, 16, 30),
    # fp16, rep 4, one span, no window (sw_index 0)
    Case(torch.float16, 1, 4, 1, 4, 64, 16, 1, 0, None, True, 32, 60),
    # fp32, rep 4, D = 40, three spans, window from the integer path, block 64
    Case(torch.float32, 1, 4, 1, 3, 150, 40, 3, 4, None, True, 64, 100),
]


def make_inputs(case: Case, gen: torch.Generator):
    q = torch.randn(case.batch, case.hq, case.lq, case.dim, generator=gen).to(case.dtype)
    k = torch.randn(case.batch, case.hkv, case.lkv, case.dim, generator=gen).to(case.dtype)
    v = torch.randn(case.batch, case.hkv, case.lkv, case.dim, generator=gen).to(case.dtype)
    # Positions from early (inside the first window) to past the last key (clamped).
    cache_position = torch.randint(0, case.lkv + 4, (case.lq,), generator=gen)
    cache_position[0] = min(3, case.lkv - 1)
    qstart, qend = random_spans(
        gen, case.batch, case.hq, cache_position, case.spans, case.lkv, case.window, case.max_span
    )
    mask = None
    if case.masked:
        mask = torch.rand(case.batch, case.lkv + 5, generator=gen) > 0.25
        mask[0, : case.lkv // 3] = False  # a long hole
    return q, k, v, qstart, qend, cache_position, mask


def reference(case: Case, q, k, v, qstart, qend, cache_position, mask):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out = span_forward_reference(q64, k64, v64, qstart, qend, cache_position, mask, case.window)
    return out, (q64, k64, v64)


def poisoned_forward(case: Case, geo: LaunchGeometry):
    out = torch.full((case.batch, case.hq, case.lq, case.spans, case.dim), float("nan"), dtype=case.dtype)
    lse = torch.full((case.batch, case.hq, case.lq, case.spans), float("nan"))
    return span_forward(geo, KernelConfig(block_k=case.block_k, num_warps=4, num_stages=2), out=(out, lse))


@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: f"{c.dtype}-rep{c.hq // c.hkv}-K{c.spans}-D{c.dim}")
def test_forward_matches_reference(case: Case, gen: torch.Generator) -> None:
    inputs = make_inputs(case, gen)
    geo = LaunchGeometry.prepare(*inputs, case.window)
    out, lse = poisoned_forward(case, geo)
    expected, _ = reference(case, *inputs)
    assert out.dtype == case.dtype
    assert_close(out, expected, case.dtype)
    assert not torch.isnan(lse).any()


def test_forward_with_no_attended_key_gives_zeros(gen: torch.Generator) -> None:
    case = FORWARD_CASES[0]
    q, k, v, qstart, qend, cache_position, _ = make_inputs(case, gen)
    qstart[0, 1] = -1
    qend[0, 1] = -1
    mask = torch.ones(case.batch, case.lkv, dtype=torch.bool)
    mask[0] = False  # batch row 0 attends nothing at all
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, mask, case.window)
    out, lse = poisoned_forward(case, geo)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isinf(lse[0]).all()
    expected, _ = reference(case, q, k, v, qstart, qend, cache_position, mask)
    assert_close(out, expected, case.dtype)


BACKWARD_CASES = FORWARD_CASES


@pytest.mark.parametrize("variant", TRITON_BACKWARD, ids=lambda v: v.name)
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda c: f"{c.dtype}-rep{c.hq // c.hkv}-K{c.spans}")
def test_backward_variants_match_reference(case: Case, variant, gen: torch.Generator) -> None:
    inputs = make_inputs(case, gen)
    geo = LaunchGeometry.prepare(*inputs, case.window)
    config = KernelConfig(block_k=case.block_k, num_warps=4, num_stages=2)
    out, lse = span_forward(geo, config)
    expected, leaves = reference(case, *inputs)
    grad_out = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    expected.backward(grad_out)
    grads = variant.launch(geo, config, out, lse, grad_out.to(case.dtype))
    # Gradients sum many terms and see the bf16/fp16 rounding of the output: looser by dtype.
    scale = 1.0 if case.dtype == torch.float32 else 4.0
    for name, got, leaf in zip("QKV", grads, leaves):
        assert got.dtype == case.dtype, name
        assert_close(got, leaf.grad, case.dtype, scale=scale)
