"""Shared test helpers: seeds, the one adapter that calls a registered variant, random inputs whose
properties the tests assert, and the tolerance rules.

``launch_variant`` is the only place where tests call a variant's ``launch`` directly: when the
registry's calling convention changes, adapt it here.
"""

from __future__ import annotations

import contextlib
import math
import os
import zlib
from dataclasses import dataclass

import oracle
import pytest
import torch

from superlinear_ops.ops.layer_search import stripe_tile_search
from superlinear_ops.ops.layer_search import tiled_search as search_kernel
from superlinear_ops.problem import DeviceIdentity, Problem

SEED_ENV = "SUPERLINEAR_OPS_TEST_SEED"  # "123" or "1,2,3": replay these seeds; "random": fresh seeds
BLOCK_K = 16  # key block the tests launch with (the smallest every kernel takes)


# --- seeds ------------------------------------------------------------------------------------


def seed_params(random_runs: int = 0) -> list:
    """The ``gen`` fixture's parameters: the seeds of SUPERLINEAR_OPS_TEST_SEED when set, else one
    fixed seed per test (derived from its name) plus ``random_runs`` fresh random seeds."""
    chosen = os.environ.get(SEED_ENV)
    if chosen == "random":
        return ["random"]
    if chosen:
        return [int(s) for s in chosen.split(",")]
    return ["fixed"] + [f"random{i}" for i in range(random_runs)]


def resolve_seed(param, test_name: str) -> int:
    """The seed for one ``gen`` parameter (see ``seed_params``)."""
    if isinstance(param, int):
        return param
    if param == "fixed":
        return zlib.crc32(test_name.encode())
    return int.from_bytes(os.urandom(4), "little")


# --- the adapter ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpanInputs:
    """Inputs of a span forward/backward call (tensors as the API takes them)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qstart: torch.Tensor
    qend: torch.Tensor
    cache_position: torch.Tensor
    mask: torch.Tensor | None
    sw_index: int
    power: oracle.Power

    @property
    def window(self) -> int:
        return oracle.window_length(self.sw_index, self.power)

    def oracle_forward(self):
        return oracle.span_forward(self.q, self.k, self.v, self.qstart, self.qend, self.cache_position, self.mask,
                                   self.window)


@dataclass(frozen=True)
class DecodeInputs:
    """Inputs of a staged-decode call."""

    q1: torch.Tensor
    q2: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache_position: torch.Tensor
    mask: torch.Tensor | None
    params: oracle.DecodeParams

    def oracle(self):
        return oracle.staged_decode(self.q1, self.q2, self.k, self.v, self.cache_position, self.mask, self.params)


def launch_variant(variant, inputs, backward_args=None, block_k: int | None = BLOCK_K, changes: dict | None = None):
    """Run one registered variant directly (no dispatcher) with its default configuration
    (``block_k`` forced when the variant tunes it, then ``changes`` applied). Skips, with the variant's own reason, when it
    does not apply. Floating buffers the variant allocates with torch.empty start as NaN, so an
    element it never writes shows. Returns (result, config).

    span_forward: result (out, lse2); span_backward: ``backward_args`` = (out, lse2, grad_out),
    result (dQ, dK, dV); staged_decode: result out.
    """
    from superlinear_ops import geometry
    from superlinear_ops.launch import LaunchGeometry
    from superlinear_ops.settings import SpanSettings

    if isinstance(inputs, DecodeInputs):
        p = inputs.params
        params = geometry.power_params(**p.power.kwargs())
        factors = (p.backward_factor, p.forward_factor, p.span_power)
        problem = Problem.for_decode(inputs.q2, inputs.k, p.topk, inputs.mask is not None, p.sw_index, params.label,
                                     factors)
    else:
        params = geometry.power_params(**inputs.power.kwargs())
        problem = Problem.for_span(variant.op, inputs.q, inputs.k, inputs.qstart.shape[-1], inputs.mask is not None,
                                   inputs.sw_index, params.label)
    reasons = variant.not_supported_reasons(problem)
    if reasons:
        pytest.skip(f"{variant.qualified_name}: {'; '.join(reasons)}")
    config = variant.default(problem)
    if block_k is not None and "block_k" in {p.name for p in variant.space}:
        config = config.replace(block_k=block_k)
    config = config.replace(**(changes or {}))
    with poisoned_allocations():
        if isinstance(inputs, DecodeInputs):
            settings = SpanSettings(p.sw_index, p.topk, p.backward_factor, p.forward_factor, p.span_power, params)
            return variant.launch(inputs.q1, inputs.q2, inputs.k, inputs.v, inputs.cache_position, inputs.mask,
                                  settings, config), config
        geo = LaunchGeometry.prepare(inputs.q, inputs.k, inputs.v, inputs.qstart, inputs.qend, inputs.cache_position,
                                     inputs.mask, inputs.window)
        if backward_args is None:
            return variant.launch(geo, config), config
        return variant.launch(geo, config, *backward_args), config


@contextlib.contextmanager
def poisoned_allocations(integer: int | None = None):
    """torch.empty / empty_like / new_empty give NaN-filled floating tensors inside the block (and,
    with ``integer``, integer tensors filled with it, or their dtype's largest value where it does not fit)."""
    originals = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        if t.is_floating_point():
            return t.fill_(float("nan"))
        if integer is None or t.dtype == torch.bool:
            return t
        return t.fill_(min(integer, torch.iinfo(t.dtype).max))

    torch.empty = lambda *a, **k: poison(originals[0](*a, **k))
    torch.empty_like = lambda *a, **k: poison(originals[1](*a, **k))
    torch.Tensor.new_empty = lambda self, *a, **k: poison(originals[2](self, *a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = originals


# --- layouts ----------------------------------------------------------------------------------


def laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` [B, H, L, D] (contiguous) as an equal tensor with the given memory layout:
    contiguous | transposed (heads and rows swapped in memory, as a model's Q) | strided (every
    other row of a wider buffer, and D with stride 2) | expanded (stride 0 over the batch: ``values``
    must be equal across batch rows)."""
    b, h, length, d = values.shape
    if layout == "contiguous":
        return values.contiguous()
    if layout == "transposed":
        return values.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided":
        wide = torch.full((b, h, 2 * length, 2 * d), float("nan"), dtype=values.dtype)
        wide[:, :, ::2, ::2] = values
        return wide[:, :, ::2, ::2]
    if layout == "expanded":
        assert torch.equal(values, values[:1].expand_as(values))
        return values[:1].expand(b, h, length, d)
    raise ValueError(layout)


def random_heads(gen: torch.Generator, shape, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A random [B, H, L, D] tensor in ``dtype`` and ``layout`` (equal batch rows for 'expanded')."""
    b, h, length, d = shape
    values = torch.randn(1 if layout == "expanded" else b, h, length, d, generator=gen).to(dtype)
    values = values.expand(b, h, length, d) if layout == "expanded" else values
    return laid_out(values, layout)


# --- tolerances -------------------------------------------------------------------------------

GRADIENT_SPREAD = 8.0
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}


def tolerance(dtype: torch.dtype, reduction: int) -> float:
    """Relative error allowed: two roundings of ``dtype`` plus fp32 accumulation over ``reduction``
    terms (a fp32-accumulating kernel sees about sqrt(n) roundings of 2**-24; float64 of 2**-53)."""
    accumulate = 8 * UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32] * math.sqrt(max(reduction, 1))
    return 2 * UNIT_ROUNDOFF[dtype] + accumulate


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, reduction: int, what: str = "",
                 spread: float = 1.0) -> None:
    """Compare with a float64 expectation; NaN never passes.

    Elementwise: |a - e| <= 2 tol * (|e| + spread * rms(e)) (a wrong element shows; twice tol
    because a result may be rounded twice, e.g. staged decode's span outputs; gradients take
    spread 8: they sum terms of both signs and see the dtype's rounding of the forward's output, so
    their errors scale with the tensor's size, not the element's); in norm: ||a - e|| <=
    tol * ||e|| (a small systematic error shows: rounding errors, including a tensor-core kernel's
    rounding of the probabilities to the input dtype, average out; a 1% scale does not, even in bf16);
    and the least-squares scale <a, e> / <e, e> within 1 +- 0.75 tol (0.59% in bf16). The tests'
    interpreter rounds fp32 to bf16 to nearest, as the GPU does (``interpreter_rounding``), so rounding
    leaves the scale unbiased and a 1% scale fails in either direction.
    """
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN in the result"
    a, e = actual.double(), expected.double()
    tol = tolerance(dtype, reduction)
    rms = e.pow(2).mean().sqrt().item() if e.numel() else 0.0
    err = (a - e).abs()
    bound = 2 * tol * (e.abs() + spread * rms) + 1e-300
    worst = (err / bound).argmax()
    assert bool((err <= bound).all()), (
        f"{what}: elementwise error {err.flatten()[worst].item():.3g} at {tuple(torch.unravel_index(worst, e.shape))} "
        f"exceeds {bound.flatten()[worst].item():.3g} (tol {tol:.3g}, got {a.flatten()[worst].item():.6g}, "
        f"expected {e.flatten()[worst].item():.6g})"
    )
    scale = (a * e).sum().item() / max(e.pow(2).sum().item(), 1e-300)
    assert abs(scale - 1) <= 0.75 * tol, f"{what}: scaled by {scale:.5f} against the expectation (allowed 1 +- {0.75 * tol:.3g})"
    norm_err = (a - e).norm().item()
    assert norm_err <= tol * e.norm().item() + 1e-300, (
        f"{what}: relative error in norm {norm_err / max(e.norm().item(), 1e-300):.3g} exceeds {tol:.3g}"
    )


class KernelSpy:
    """Counts the launches of a Triton kernel (stands in for it in its module)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


class LaunchSpy:
    """Stands in for a Triton kernel in its module and records each launch's ``KV_TMA`` (whether it
    loaded whole key blocks through TMA descriptors; ``tma_flag`` names another such flag, e.g. the
    window dK/dV kernel's ``ROWS_TMA``, or None for a kernel without one), ``EDGE_TMA`` (its edge
    blocks too; False for a kernel without the flag), ``TILES`` (which tiles it took; None without
    the flag) and all its arguments by parameter name; with ``log``, also appends ``name`` to it at
    each launch (the order of launches across kernels)."""

    def __init__(self, kernel, log: list | None = None, name: str = "", tma_flag: str | None = "KV_TMA") -> None:
        self.kernel, self.tma, self.edge_tma, self.tiles, self.log, self.name = kernel, [], [], [], log, name
        self.tma_flag, self.arguments = tma_flag, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.arguments.append(dict(zip(self.kernel.arg_names, args)) | kwargs)
            if self.tma_flag is not None:
                self.tma.append(kwargs[self.tma_flag])
            self.edge_tma.append(kwargs.get("EDGE_TMA", False))
            self.tiles.append(kwargs.get("TILES"))
            if self.log is not None:
                self.log.append(self.name)
            return self.kernel[grid](*args, **kwargs)
        return launch


TRITON_SEARCHES = {  # Triton search variant: (its kernel's module, the kernel's name)
    "tiled_search": (search_kernel, "layer_search_kernel"),
    "stripe_tiles": (stripe_tile_search, "stripe_tile_search_kernel"),
}


class SearchSpies(dict):
    """A KernelSpy per Triton search variant; ``launches`` counts them all."""

    @property
    def launches(self) -> int:
        return sum(spy.launches for spy in self.values())


H200 = DeviceIdentity("NVIDIA H200", "sm_90", 132)


def problem(**changes) -> Problem:
    """Model M's 8192-query span forward over 139,000 keys on an H200, with ``changes``."""
    base = Problem(
        op="span_forward", dtype="bfloat16", head_dim=128, q_heads=32, kv_heads=2, spans=3, queries=8192,
        keys=139000, batch=1, masked=False, sw_index=65, power="float0.55", device=H200,
    )
    return base._replace(**changes)
