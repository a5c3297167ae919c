"""Dense SDPA beside each problem in ``bench`` and ``verify``: calls too large to time in reasonable
time (about a second or more each) are skipped with their reason, the rest are timed."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from superlinear_ops.ops.spec import DenseCalls, dense_flops
from superlinear_ops.problem import SPAN_BACKWARD, SPAN_FORWARD, device_identity
from superlinear_ops.registry import REGISTRY
from superlinear_ops.tuner.bench import DENSE_BACKENDS, DENSE_FLOP_LIMIT, dense_times
from superlinear_ops.tuner.workload import load


def bench_with(flops: float, ran: list[bool]) -> SimpleNamespace:
    """A problem bench whose op's dense call records that it ran, declaring ``flops``."""
    def make_call(expand: bool):
        return lambda: ran.append(expand)

    dense = DenseCalls("toy dense", (make_call,), flops=flops)
    spec = SimpleNamespace(dense=lambda case, inputs: dense)
    return SimpleNamespace(spec=spec, case=None, inputs=None, device=torch.device("cpu"))


def test_a_dense_call_above_the_limit_is_not_run_and_says_why():
    ran: list[bool] = []
    times = dense_times(bench_with(2 * DENSE_FLOP_LIMIT, ran))
    assert ran == []
    assert set(times.by_backend) == set(DENSE_BACKENDS)
    assert all(reason.startswith("not timed: 2.0 PFLOP a call") for reason in times.by_backend.values())
    name, ms = times.fastest
    assert name == "none" and math.isnan(ms)


def test_a_dense_call_at_the_limit_is_timed_under_each_backend():
    ran: list[bool] = []
    times = dense_times(bench_with(DENSE_FLOP_LIMIT, ran))
    assert len(ran) >= len(DENSE_BACKENDS)  # each backend ran the call (warm-up and timed runs)
    assert set(times.by_backend) == set(DENSE_BACKENDS)
    assert all(isinstance(ms, float) and ms >= 0 for ms in times.by_backend.values())


def test_dense_flops_counts_4d_per_query_head_and_key_half_when_causal():
    q = torch.empty(2, 8, 100, 64, device="meta")
    assert dense_flops(q, 300, causal=False) == 4 * 64 * 2 * 8 * 100 * 300
    assert dense_flops(q, 300, causal=True) == 2 * 64 * 2 * 8 * 100 * 300


def meta_inputs(case) -> SimpleNamespace:
    """Shape-only inputs of ``case`` (the dense FLOPs read shapes; nothing is allocated)."""
    p = case.problem
    q = torch.empty(p.batch, p.q_heads, p.queries, p.head_dim, device="meta", dtype=p.torch_dtype)
    k = torch.empty(p.batch, p.kv_heads, p.keys, p.head_dim, device="meta", dtype=p.torch_dtype)
    return SimpleNamespace(q=q, k=k, v=k)


@pytest.mark.parametrize(("label", "timed"), [
    ("prefill 32768 over 9967232", False),  # about 5.4 PFLOP: over a second a call on any GPU
    ("prefill 32768 over 1015808", True),
    ("training 65536 backward", True),
])
def test_model_m_dense_calls_are_timed_up_to_1m_keys_and_skipped_at_10m(label, timed):
    cases = {c.label: c for c in load("tuning/superlinear-exp-v0.1.yaml").cases(device_identity(torch.device("cpu")))}
    case = cases[label]
    p = case.problem
    dense = REGISTRY.spec(p.op).dense(case, meta_inputs(case))
    causal = p.op == SPAN_BACKWARD or p.queries == p.keys
    forward = 4.0 * p.head_dim * p.batch * p.q_heads * p.queries * p.keys * (0.5 if causal else 1.0)
    assert p.op in (SPAN_FORWARD, SPAN_BACKWARD)
    assert dense.flops == pytest.approx(forward * (3.5 if p.op == SPAN_BACKWARD else 1.0))
    assert (dense.flops <= DENSE_FLOP_LIMIT) == timed
