"""The lower bound beside each benchmark figure: bytes over the GPU's own copy bandwidth or FLOPs over
its own tensor-core rate, whichever takes longer; no figure for a GPU without measured peaks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from superlinear_ops.tuner.bench import PEAKS, bound_of_traffic, device_peaks

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def case_on(gpu: str) -> SimpleNamespace:
    """A case whose problem runs on the GPU named ``gpu`` (all ``bound_of_traffic`` reads of it)."""
    return SimpleNamespace(problem=SimpleNamespace(device=SimpleNamespace(name=gpu)))


def test_each_gpu_has_its_own_peaks():
    assert device_peaks(H100) == (3.0e12, 798e12)
    assert device_peaks(H200) == (4.3e12, 790e12)


@pytest.mark.parametrize("gpu", [H100, H200])
def test_a_bytes_bound_case_takes_bytes_over_that_gpus_bandwidth(gpu):
    bandwidth, rate = PEAKS[gpu]
    ms, basis = bound_of_traffic(case_on(gpu), bytes_=2 * bandwidth / 1e3, flops=rate / 1e3)
    assert ms == pytest.approx(2.0, rel=1e-12)
    assert f"{bandwidth / 1e12:.1f} TB/s" in basis


@pytest.mark.parametrize("gpu", [H100, H200])
def test_a_flops_bound_case_takes_flops_over_that_gpus_tensor_rate(gpu):
    bandwidth, rate = PEAKS[gpu]
    ms, basis = bound_of_traffic(case_on(gpu), bytes_=bandwidth / 1e3, flops=3 * rate / 1e3)
    assert ms == pytest.approx(3.0, rel=1e-12)
    assert f"{rate / 1e12:.0f} TFLOP/s" in basis


def test_the_same_traffic_is_bound_lower_on_the_gpu_with_more_bandwidth():
    h100, _ = bound_of_traffic(case_on(H100), bytes_=1e9, flops=0.0)
    h200, _ = bound_of_traffic(case_on(H200), bytes_=1e9, flops=0.0)
    assert h100 == pytest.approx(1e3 / 3.0e3, rel=1e-12)
    assert h200 == pytest.approx(1e3 / 4.3e3, rel=1e-12)


def test_a_gpu_without_measured_peaks_gets_no_bound_and_says_so():
    assert all(math.isnan(x) for x in device_peaks("NVIDIA RTX 9999"))
    ms, basis = bound_of_traffic(case_on("NVIDIA RTX 9999"), bytes_=1e9, flops=1e12)
    assert math.isnan(ms)
    assert "no peak figures" in basis
