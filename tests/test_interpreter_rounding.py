"""The tests' interpreter converts fp32 to bf16 as the GPU does: to nearest, ties to even."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's conversion only")


@triton.jit
def _store_and_cast(src_ptr, stored_ptr, cast_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n)
    tl.store(stored_ptr + offs, x, mask=offs < n)  # fp32 stored into bf16 memory
    tl.store(cast_ptr + offs, x.to(tl.bfloat16), mask=offs < n)


def test_fp32_to_bf16_rounds_to_nearest_even_in_stores_and_casts(gen):
    ties = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8)])  # halfway: to even
    specials = torch.tensor([float("inf"), -float("inf"), 3.3961e38, 1e-40, 0.0, -0.0])  # overflow, subnormal
    x = torch.cat([torch.randn(1000, generator=gen) * 100, ties, specials])
    stored, cast = (torch.full(x.shape, float("nan"), dtype=torch.bfloat16) for _ in range(2))
    _store_and_cast[(triton.cdiv(x.numel(), 256),)](x, stored, cast, x.numel(), BLOCK=256)
    want = x.to(torch.bfloat16)
    assert torch.equal(stored.view(torch.int16), want.view(torch.int16))
    assert torch.equal(cast.view(torch.int16), want.view(torch.int16))
    assert torch.equal(want[1000:1003].float(), torch.tensor([1.0, 1.0 + 4 * 2.0**-8, -1.0]))  # the ties went to even
