"""The float64 reference over key blocks: its memory grows with the rows and the keys they attend,
never with Lkv x query heads. With blocks of a few keys (so every span and window crosses several,
and rows come in several chunks) the span forward and the staged decode built on it match the
independent oracle; float64 decode at 1M keys with model M's heads stays under 8 GB; the long-context
check script runs at a small size."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import subprocess
import sys

import oracle
import pytest
import torch
from helpers import problem

from superlinear_ops.dispatch import Dispatcher
from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.span_attention import reference
from superlinear_ops.problem import STAGED_DECODE
from superlinear_ops.registry import REGISTRY
from superlinear_ops.settings import SpanSettings

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu_reference_10m.py"


@pytest.fixture
def small_blocks(monkeypatch):
    """Key blocks of 7 keys and at most 20 scores per step: 2 rows per chunk."""
    monkeypatch.setattr(reference, "KEY_BLOCK", 7)
    monkeypatch.setattr(reference, "SCORE_BLOCK", 20)


def _spans(gen: torch.Generator, batch: int, hq: int, lq: int, slots: int, lkv: int):
    """qstart/qend with empty slots (-1), spans reaching into the window (clamped) and past the keys."""
    qstart = torch.randint(0, lkv, (batch, hq, lq, slots), generator=gen)
    qend = qstart + torch.randint(0, 25, (batch, hq, lq, slots), generator=gen)
    unused = torch.rand(batch, hq, lq, slots, generator=gen) < 0.2
    return torch.where(unused, -1, qstart), torch.where(unused, -1, qend)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("masked", [False, True])
def test_span_forward_over_many_key_blocks_matches_the_oracle(window: int, masked: bool, gen: torch.Generator,
                                                              small_blocks) -> None:
    batch, hq, hkv, lq, slots, lkv, dim = 2, 6, 2, 5, 3, 61, 8
    q = torch.randn(batch, hq, lq, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, hkv, lkv, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    qstart, qend = _spans(gen, batch, hq, lq, slots, lkv)
    positions = torch.tensor([3, 20, 40, 60, 70])  # 70: past the keys, acts as Lkv - 1
    mask = (torch.rand(batch, lkv + 4, generator=gen) < 0.7).to(torch.int64) if masked else None
    out, lse = reference.span_forward_reference(q, k, v, qstart, qend, positions, mask, window, return_lse=True)
    want, want_lse = oracle.span_forward(q, k, v, qstart, qend, positions, mask, window)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    assert not bool(torch.isnan(out).any()) and torch.allclose(out, want, rtol=0, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and bool((~torch.isinf(want_lse)).any())
    finite = ~torch.isinf(want_lse)
    assert torch.allclose(lse[finite].double(), want_lse[finite], rtol=1e-6, atol=1e-6)
    empty = (out == 0).all(dim=-1)  # no key attended (only without a window)
    assert bool(empty.any()) == (window == 0) and not bool(empty.all())


def test_span_forward_over_many_key_blocks_keeps_the_non_finite_rules(gen: torch.Generator, monkeypatch) -> None:
    """NaN in Q or an attended K row poisons the row; an attended non-finite V shows; neither reaches
    another row: small blocks give exactly the single-block result (docs/semantics.md section 2)."""
    batch, hq, hkv, lq, slots, lkv, dim = 1, 4, 2, 4, 2, 50, 8
    q = torch.randn(batch, hq, lq, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, hkv, lkv, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    q[0, 1, 2, 3] = math.nan
    k[0, 0, 23, 1], v[0, 1, 30, 2], v[0, 1, 31, 2], v[0, 0, 48, 0] = math.nan, math.inf, -math.inf, math.inf
    qstart, qend = _spans(gen, batch, hq, lq, slots, lkv)
    qstart[0, :2, 3], qend[0, :2, 3] = -1, -1  # the window alone, past the NaN key: the infinite value shows
    args = (q, k, v, qstart, qend, torch.tensor([10, 25, 35, 49]), None, 4)
    whole = reference.span_forward_reference(*args, return_lse=True)
    monkeypatch.setattr(reference, "KEY_BLOCK", 3)
    monkeypatch.setattr(reference, "SCORE_BLOCK", 3)
    blocked = reference.span_forward_reference(*args, return_lse=True)
    for got, want in zip(blocked, whole):
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))
        assert bool(torch.isnan(want).any()) and bool(torch.isfinite(want).any())
        finite = torch.isfinite(want)
        assert torch.allclose(got[finite].double(), want[finite].double(), rtol=0, atol=1e-12)
    assert bool(torch.isinf(whole[0]).any())  # an attended infinite value shows


@pytest.mark.parametrize("masked", [False, True])
def test_staged_decode_reference_over_many_key_blocks_matches_the_oracle(masked: bool, gen: torch.Generator,
                                                                         small_blocks) -> None:
    batch, hq, hkv, lkv, dim = 2, 8, 2, 150, 16
    power = oracle.Power.of(search_power=0.55)
    params = oracle.DecodeParams(6, 3, 3.0, 1.0, 0.55, power)
    q1, q2 = (torch.randn(batch, hq, 1, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(batch, hkv, lkv, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    position = torch.tensor([lkv - 1])
    mask = None
    if masked:
        mask = torch.ones(batch, lkv, dtype=torch.int64)
        mask[1, :9] = 0
        mask[:, 60:64] = 0
    settings = SpanSettings.checked(lkv, 6, 3, 3.0, 1.0, 0.55, 0.55, None)
    variant = REGISTRY.reference(STAGED_DECODE)
    got = variant.launch(q1, q2, k, v, position, mask, settings, KernelConfig())
    want, _ = oracle.staged_decode(q1, q2, k, v, position, mask, params)
    assert got.dtype == torch.float64 and not bool(torch.isnan(got).any())
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_the_float64_forward_reference_serves_10m_keys() -> None:
    """The dispatcher no longer refuses the forward reference at long context (8 layer rows or a
    decode over 10M keys): its memory does not grow with the keys x query heads."""
    for p in (problem(dtype="float64", queries=8, keys=10_000_000), problem(op=STAGED_DECODE, dtype="float64", queries=1,
                                                                           keys=10_000_000, factors=(3.0, 1.0, 0.55))):
        assert Dispatcher(REGISTRY).select(p).variant.name in ("reference", "staged_reference")


DECODE_1M = """
import resource, torch
from superlinear_ops import decode_span_attention_staged_gqa
gen = torch.Generator().manual_seed(0)
k, v = (torch.randn(1, 2, 1 << 16, 128, generator=gen, dtype=torch.float64).repeat(1, 1, 16, 1) for _ in range(2))
q1, q2 = (torch.randn(1, 32, 1, 128, generator=gen, dtype=torch.float64) for _ in range(2))
inputs = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
out = decode_span_attention_staged_gqa(q1, q2, k, v, torch.tensor([(1 << 20) - 1]), None, sw_index=65, topk=3,
                                       backward_factor=3.0, forward_factor=1.0, span_power=0.55, search_power=0.55,
                                       inv_search_power_int=None)
assert out.dtype == torch.float64 and bool(torch.isfinite(out).all())
print(inputs, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
"""


def test_float64_decode_at_1m_keys_with_model_m_heads_stays_under_8_gb() -> None:
    """Model M's heads (32 over 2, D 128) at 1,048,576 float64 keys (4 GiB of K and V): peak RSS of
    the whole process, inputs included, under 8 GB, and the decode itself under 1 GiB beyond them."""
    run = subprocess.run([sys.executable, "-c", DECODE_1M], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=False, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    inputs_gib, peak_gib = map(float, run.stdout.split())
    print(f"peak RSS {peak_gib:.2f} GiB, {inputs_gib:.2f} GiB once the inputs were built")
    assert peak_gib * 2**30 < 8e9 and peak_gib - inputs_gib < 1.0


def _script():
    spec = importlib.util.spec_from_file_location("gpu_reference_10m", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = ["--device", "cpu", "--dtype", "float32", "--keys", "700", "--chunk", "24", "--rows", "2", "--q-heads", "4",
         "--head-dim", "16", "--sw-index", "3"]


def test_the_long_context_check_runs_at_a_small_size(capsys) -> None:
    """The kernels (under the interpreter) against the float64 reference, decode and three places of
    the chunk; a tolerance no fp32 result meets fails it."""
    script = _script()
    assert script.main(SMALL) == 0
    shown = capsys.readouterr().out
    assert shown.count("ok 0.01") == 4 and "decode at position 699" in shown and "(end; positions 698.." in shown
    assert script.main([*SMALL, "--tolerance", "1e-12"]) == 1
    assert "FAILED" in capsys.readouterr().out
