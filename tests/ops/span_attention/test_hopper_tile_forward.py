"""The Gluon window and span tiles (sm_90 only): against the float64 span forward on an sm_90 GPU,
and the reasons they are refused everywhere else."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from helpers import assert_close, poisoned_allocations
from tile_cases import random_spans

from superlinear_ops import geometry
from superlinear_ops.launch import KernelConfig, LaunchGeometry
from superlinear_ops.ops.span_attention.reference import span_forward_reference
from superlinear_ops.ops.span_attention.variants import HOPPER_DEFAULTS, HOPPER_FORWARD, hopper_check
from superlinear_ops.problem import SPAN_FORWARD, DeviceIdentity, Problem

ON_HOPPER = (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
             and os.environ.get("TRITON_INTERPRET") != "1")
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="Gluon warp specialisation and wgmma: an sm_90 GPU, kernels "
                                  "compiled (SUPERLINEAR_OPS_TEST_COMPILED=1)")
H100 = DeviceIdentity("NVIDIA H100 80GB HBM3", "sm_90", 132)
SW_INDEX = 20  # float path 0.55: W = 252, wider than the widest key block


def problem(**change) -> Problem:
    fields = dict(op=SPAN_FORWARD, dtype="bfloat16", head_dim=128, q_heads=32, kv_heads=2, spans=3, queries=8192,
                  keys=16384, batch=1, masked=False, sw_index=65, power="float0.55", device=H100)
    return Problem(**{**fields, **change})


@pytest.mark.parametrize("change, reason", [
    ({"device": DeviceIdentity("cpu", "interpreter", 0)}, "needs an sm_90 GPU"),
    ({"device": DeviceIdentity("NVIDIA A100", "sm_80", 108)}, "needs an sm_90 GPU"),
    ({"dtype": "float32"}, "take bfloat16 or float16"),
    ({"head_dim": 96}, "head dim 96"),
    ({"masked": True}, "an attention mask"),
])
def test_refused_with_a_reason(change: dict, reason: str):
    reasons = HOPPER_FORWARD.reasons(problem(**change))
    assert any(reason in r for r in reasons), reasons


def test_serves_model_m_on_sm_90():
    assert HOPPER_FORWARD.reasons(problem()) == []
    assert hopper_check(problem(), HOPPER_FORWARD.default(problem())) is None


def test_serves_windows_narrower_than_a_key_block():
    """W 11 (sw_index 3): every tile's last block runs past its range, whose values are zeroed."""
    assert HOPPER_FORWARD.reasons(problem(sw_index=3)) == []


@pytest.mark.parametrize("part", ["window", "span"])
def test_shared_memory_check_refuses_what_does_not_fit(part: str):
    """128 rows and four stages of 128-key K/V blocks need 288 KB; three stages fit (compiled: 229,792 bytes)."""
    config = KernelConfig({**HOPPER_DEFAULTS, f"{part}_block_n": 128, f"{part}_stages": 4})
    assert f"the {part} kernel's" in hopper_check(problem(), config)
    assert hopper_check(problem(), config.replace(**{f"{part}_stages": 3})) is None
    assert hopper_check(problem(device=DeviceIdentity("cpu", "interpreter", 0)), config) is None


def test_default_fits_every_head_dim_it_serves():
    for head_dim in (64, 128):
        narrow = problem(head_dim=head_dim)
        assert hopper_check(narrow, HOPPER_FORWARD.default(narrow)) is None


# --- on an sm_90 GPU: against the float64 reference --------------------------------------------

def both_kernels(n: int, stages: int, turns: int) -> dict:
    """The window and span kernels on the same tiles."""
    return {f"{part}_{name}": value for part in ("window", "span")
            for name, value in (("block_n", n), ("stages", stages), ("mma_turns", turns))}


CONFIGS = [both_kernels(*tiles) for tiles in itertools.product((64, 128), (2, 3, 4), (2, 1))
           if hopper_check(problem(), KernelConfig(both_kernels(*tiles))) is None]


def config_id(config: dict) -> str:
    return f"n{config['span_block_n']}-s{config['span_stages']}-t{config['span_mma_turns']}"


def gpu_inputs(gen: torch.Generator, batch: int, hq: int, hkv: int, lq: int, lkv: int, dim: int, max_span: int,
               consecutive: bool, filled: int | None = None, dtype: torch.dtype = torch.bfloat16, sw_index: int = SW_INDEX):
    """Inputs with spans ending before each window (W = 252 by default); keys from ``filled`` on are
    an unwritten static-cache tail of NaN (positions end before it)."""
    window = geometry.window_len_from_sw_index(sw_index, search_power=0.55, inv_search_power_int=None)
    filled = filled or lkv
    q = torch.randn(batch, hq, lq, dim, generator=gen).to(dtype)
    k = torch.randn(batch, hkv, lkv, dim, generator=gen).to(dtype)
    v = torch.randn(batch, hkv, lkv, dim, generator=gen).to(dtype)
    k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")
    if consecutive:
        positions = torch.arange(filled - lq, filled)
    else:
        positions = torch.randint(0, filled, (lq,), generator=gen)
    qstart, qend = random_spans(gen, batch, hq, positions, 3, lkv, window, max_span)
    cpu = (q, k, v, qstart, qend, positions)
    return cpu, window


def check_hopper(cpu_inputs, window: int, config: dict):
    from superlinear_ops.ops.span_attention.hopper_tile_forward import span_forward_hopper

    q, k, v, qstart, qend, positions = (t.cuda() for t in cpu_inputs)
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, positions, None, window)
    with poisoned_allocations():
        out, lse = span_forward_hopper(geo, config)
    torch.cuda.synchronize()
    q, k, v, qstart, qend, positions = cpu_inputs
    ref_out, ref_lse = span_forward_reference(q.double(), k.double().nan_to_num(0, 0, 0), v.double().nan_to_num(0, 0, 0),
                                              qstart, qend, positions, None, window, return_lse=True)
    out, lse = out.cpu(), lse.cpu()
    assert_close(out, ref_out, q.dtype, k.shape[2], "out")
    nobody = torch.isinf(ref_lse)
    assert torch.equal(torch.isposinf(lse), nobody), "lse is +inf exactly where no key is attended"
    assert_close(lse[~nobody], ref_lse[~nobody], torch.float32, k.shape[2], "lse")


@needs_hopper
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_long_spans_across_many_key_blocks(config: dict):
    """Model M's groups (rep 16), spans up to 1,500 keys: tiles with many inner blocks and edges."""
    gen = torch.Generator().manual_seed(0)
    check_hopper(*gpu_inputs(gen, 1, 32, 2, 384, 6000, 128, 1500, True), config)


@needs_hopper
@pytest.mark.parametrize("config", CONFIGS[:2], ids=config_id)
def test_short_spans_random_positions_batch_two_static_cache_tail(config: dict):
    """B 2, rep 4, D 64, random positions, spans of 1 to 40 keys (tiles spread over many blocks,
    most rows masked in most blocks), rows at t <= W with no span, and a NaN tail of unwritten keys."""
    gen = torch.Generator().manual_seed(1)
    check_hopper(*gpu_inputs(gen, 2, 8, 2, 300, 3000, 64, 40, False, filled=2900), config)


@needs_hopper
def test_float16():
    """fp16 inputs (the probabilities meet V in fp16), B 1, rep 16, the default tiles."""
    gen = torch.Generator().manual_seed(2)
    check_hopper(*gpu_inputs(gen, 1, 32, 2, 256, 4000, 128, 600, True, dtype=torch.float16), dict(HOPPER_DEFAULTS))


@needs_hopper
@pytest.mark.parametrize("config", [c for c in CONFIGS if c["span_block_n"] == 128][:2],
                         ids=config_id)
def test_narrow_window_before_a_nan_tail(config: dict):
    """W 11, narrower than a key block, and queries up to the last written key before a NaN tail: the
    last block of nearly every window and span tile loads keys past its range (later queries' keys,
    unwritten NaN ones, the next group's), which must reach no output."""
    gen = torch.Generator().manual_seed(3)
    check_hopper(*gpu_inputs(gen, 2, 8, 2, 200, 1024, 128, 30, True, filled=1000, sw_index=3), config)


@needs_hopper
def test_window_part_alone():
    """Every slot unused: each row is its query's window part, from the window kernel alone (spans
    of nothing merge nothing); B 1, rep 16, queries from key 0 (rows at t <= W)."""
    gen = torch.Generator().manual_seed(4)
    (q, k, v, qstart, qend, positions), window = gpu_inputs(gen, 1, 32, 2, 700, 700, 128, 1, True)
    check_hopper((q, k, v, torch.full_like(qstart, -1), torch.full_like(qend, -1), positions), window, dict(HOPPER_DEFAULTS))
