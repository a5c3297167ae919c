"""Staged decode (Triton interpreter, and the float64 reference path) against the SPEC oracle."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from conftest import assert_close

from superlinear_ops import decode_span_attention_staged, decode_span_attention_staged_gqa, geometry
from superlinear_ops.decode.settings import DecodeSettings
from superlinear_ops.kernels.launch import KernelConfig
from superlinear_ops.reference import decode_reference
from superlinear_ops.registry import REGISTRY


@dataclass(frozen=True)
class DecodeCase:
    dtype: torch.dtype = torch.float32
    batch: int = 2
    hq: int = 4
    hkv: int = 2
    lkv: int = 160
    pos: int = 150
    dim: int = 24
    sw_index: int = 3
    topk: int = 3
    backward_factor: float = 2.0
    forward_factor: float = 0.0
    span_power: float = 0.5
    search_power: float | None = None  # None: inv_search_power_int=2
    mask: str = "none"  # none | holes | prefix (static cache: keys after pos masked) | window_only

    def power_kwargs(self) -> dict:
        if self.search_power is None:
            return dict(search_power=None, inv_search_power_int=2)
        return dict(search_power=self.search_power, inv_search_power_int=None)

    @property
    def window(self) -> int:
        return geometry.window_len_from_sw_index(self.sw_index, **self.power_kwargs())


CASES = {
    "integer-path": DecodeCase(),
    "forward-factor-mask-holes": DecodeCase(forward_factor=1.0, mask="holes"),
    "float-path-model-m-like": DecodeCase(
        search_power=0.55, span_power=0.55, backward_factor=3.0, forward_factor=1.0, sw_index=4, lkv=200, pos=190
    ),
    "static-cache-bigger-than-prefix": DecodeCase(lkv=256, pos=120, mask="prefix", forward_factor=1.0),
    "short-prefix-t-le-W": DecodeCase(pos=10, lkv=64, mask="prefix"),
    "no-valid-stripe": DecodeCase(mask="window_only"),
    "topk-larger-than-stripes": DecodeCase(lkv=40, pos=39, sw_index=2, topk=6),
    "bf16-rep4": DecodeCase(dtype=torch.bfloat16, hq=8, hkv=2, forward_factor=0.5),
    "mha-fp16-no-window": DecodeCase(dtype=torch.float16, hq=2, hkv=2, sw_index=0),
    "window-over-several-chunks": DecodeCase(sw_index=9, lkv=400, pos=380, forward_factor=1.0),  # W = 99
}


def make_decode_inputs(case: DecodeCase, gen: torch.Generator):
    shape_q = (case.batch, case.hq, 1, case.dim)
    shape_kv = (case.batch, case.hkv, case.lkv, case.dim)
    q1, q2 = (torch.randn(shape_q, generator=gen).to(case.dtype) for _ in range(2))
    k, v = (torch.randn(shape_kv, generator=gen).to(case.dtype) for _ in range(2))
    cache_position = torch.arange(case.pos - 2, case.pos + 1)
    mask = None
    if case.mask != "none":
        mask = torch.ones(case.batch, case.lkv, dtype=torch.bool)
        if case.mask == "holes":
            mask = torch.rand(case.batch, case.lkv, generator=gen) > 0.3
            mask[1, :20] = False  # row 1 starts later: its own first allowed key
        elif case.mask == "prefix":
            mask[:, case.pos + 1 :] = False
        elif case.mask == "window_only":
            mask[:, : max(case.pos - case.window + 1, 0)] = False
    return q1, q2, k, v, cache_position, mask


def run(case: DecodeCase, inputs, **extra):
    return decode_span_attention_staged_gqa(
        *inputs, sw_index=case.sw_index, topk=case.topk, backward_factor=case.backward_factor,
        forward_factor=case.forward_factor, span_power=case.span_power, **case.power_kwargs(), **extra,
    )


def oracle(case: DecodeCase, inputs):
    params = geometry.power_params(**case.power_kwargs())
    return decode_reference(
        *inputs, sw_index=case.sw_index, topk=case.topk, backward_factor=case.backward_factor,
        forward_factor=case.forward_factor, span_power=case.span_power, params=params,
    )


@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_spec_oracle(name: str, gen: torch.Generator) -> None:
    case = CASES[name]
    inputs = make_decode_inputs(case, gen)
    got = run(case, inputs, block_k=16)
    assert got.shape == (case.batch, case.hq, 1, case.dim) and got.dtype == case.dtype
    assert_close(got, oracle(case, inputs), case.dtype)


@pytest.mark.parametrize("variant_name", ["split_window", "grouped"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_variants_match_spec_oracle(name: str, variant_name: str, gen: torch.Generator) -> None:
    case = CASES[name]
    inputs = make_decode_inputs(case, gen)
    settings = DecodeSettings(case.sw_index, case.topk, case.backward_factor, case.forward_factor, case.span_power,
                              geometry.power_params(**case.power_kwargs()))
    variant = REGISTRY.get("staged_decode", variant_name)
    got = variant.launch(*inputs, settings, KernelConfig(block_k=16, num_warps=4, num_stages=2, chunk=128))
    assert got.shape == (case.batch, case.hq, 1, case.dim) and got.dtype == case.dtype
    assert_close(got, oracle(case, inputs), case.dtype)


@pytest.mark.parametrize("name", ["integer-path", "float-path-model-m-like", "short-prefix-t-le-W"])
def test_decode_reference_path_float64(name: str, gen: torch.Generator) -> None:
    case = replace(CASES[name], dtype=torch.float32)
    inputs = [t.double() if t is not None and t.is_floating_point() else t for t in make_decode_inputs(case, gen)]
    got = run(case, inputs)
    assert got.dtype == torch.float64
    # Scores and the gate are fp32 by definition (SPEC section 3); everything else is float64.
    torch.testing.assert_close(got, oracle(case, inputs), atol=1e-6, rtol=1e-6)


def test_short_prefix_equals_plain_attention(gen: torch.Generator) -> None:
    case = CASES["short-prefix-t-le-W"]
    inputs = make_decode_inputs(case, gen)
    staged = run(case, inputs, block_k=16)
    plain = run(case, inputs, block_k=16, force_mode="sdpa")
    assert_close(staged, plain.double(), case.dtype)
    span_only = run(case, inputs, block_k=16, force_mode="span")
    assert torch.equal(span_only, staged)


def test_mha_entry_point_matches_gqa_entry_point(gen: torch.Generator) -> None:
    case = CASES["mha-fp16-no-window"]
    inputs = make_decode_inputs(case, gen)
    mha = decode_span_attention_staged(
        *inputs, case.sw_index, case.topk, case.backward_factor, case.forward_factor, block_k=16
    )
    assert torch.equal(mha, run(case, inputs, block_k=16))


@pytest.mark.parametrize("name", ["staged", "split_window", "grouped"])
def test_negative_decode_position_stays_in_bounds(name: str, gen: torch.Generator, monkeypatch) -> None:
    """Without validation a negative position is treated as 0: no out-of-bounds table read."""
    from superlinear_ops import dispatch

    case = CASES["forward-factor-mask-holes"]
    q1, q2, k, v, _, mask = make_decode_inputs(case, gen)
    monkeypatch.setattr(dispatch.DISPATCHER, "select", lambda p: dispatch.Choice(
        REGISTRY.get("staged_decode", name), KernelConfig(block_k=16, num_warps=4, num_stages=2, chunk=128), "test"))
    got = run(case, (q1, q2, k, v, torch.tensor([-7]), mask))
    expected = run(case, (q1, q2, k, v, torch.tensor([0]), mask))
    assert torch.isfinite(got).all() and torch.equal(got, expected)
    with pytest.raises(ValueError, match="cache_position"):
        run(case, (q1, q2, k, v, torch.tensor([-7]), mask), validate=True)


@pytest.mark.parametrize("name", ["forward-factor-mask-holes", "static-cache-bigger-than-prefix"])
def test_grouped_first_allowed_key_over_several_mask_slices(name: str, gen: torch.Generator, monkeypatch) -> None:
    """The grouped variant finds each row's first allowed key from per-slice minima (slices dealt
    over the KV groups); small slices make several, the first of them wholly masked."""
    from superlinear_ops.decode import grouped_kernels as decode_grouped

    monkeypatch.setattr(decode_grouped, "MASK_SLICE", 16)
    case = CASES[name]
    q1, q2, k, v, cache_position, mask = make_decode_inputs(case, gen)
    mask[:, :50] = False
    mask[0, 50:70] = False  # rows start at different slices
    inputs = (q1, q2, k, v, cache_position, mask)
    settings = DecodeSettings(case.sw_index, case.topk, case.backward_factor, case.forward_factor, case.span_power,
                              geometry.power_params(**case.power_kwargs()))
    got = REGISTRY.get("staged_decode", "grouped").launch(*inputs, settings, KernelConfig(block_k=16, num_warps=4, num_stages=2, chunk=128))
    assert_close(got, oracle(case, inputs), case.dtype)
