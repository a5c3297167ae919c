"""The layer's gate as registered ops (gate scores, the gate, and their backwards).

Every variant, at its default and at each corner of its declared space, against a float64 oracle
written here from docs/semantics.md section 4, step 4 alone (loops over rows, as ``oracle.layer_head`` computes
the gate), its outputs NaN-prefilled; empty slots (anchor -1) whose stand-in key row and Q1 row
hold NaN; B 2, rep 1, 2, 4 and 16, D 64, 96 (padded), 128 and 256, fewer rows than the largest row block. Then the
dispatch: the layer's gate steps choose through the registry, a tuned configuration and an explicit
choice reach the kernels, the layer's reference run is PyTorch in float64; the tuner's
``ProblemBench`` checks, times and rejects candidates of every gate op; the CLI lists them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import oracle
import pytest
import torch
from helpers import GRADIENT_SPREAD, assert_close
from triton.runtime.interpreter import InterpretedFunction

import superlinear_ops
from superlinear_ops import dispatch
from superlinear_ops.buckets import key_of
from superlinear_ops.cli import main
from superlinear_ops.dispatch import LayerAnswer, TunedChoice
from superlinear_ops.launch import KernelConfig
from superlinear_ops.problem import GATE, GATE_BACKWARD, GATE_SCORES, GATE_SCORES_BACKWARD, DeviceIdentity, Problem, device_identity
from superlinear_ops.registry import REGISTRY, Variant
from superlinear_ops.tuner import runner
from superlinear_ops.tuner.nan_fill import nan_prefilled
from superlinear_ops.tuner.runner import CandidateFailed, ProblemBench
from superlinear_ops.tuner.workload import Case

CPU = torch.device("cpu")
GATE_OPS = (GATE_SCORES, GATE_SCORES_BACKWARD, GATE, GATE_BACKWARD)
TRITON = "row_blocks"
EMPTY = oracle.EMPTY_GATE_SCORE


@dataclass(frozen=True)
class GateCase:
    name: str
    hq: int
    hkv: int
    dim: int
    dtype: torch.dtype = torch.float32
    batch: int = 2
    lq: int = 5
    lkv: int = 12
    topk: int = 3

    @property
    def rows(self) -> int:
        return self.batch * self.hq * self.lq


CASES = [
    GateCase("mha-d64", hq=2, hkv=2, dim=64),  # 20 rows: fewer than the largest row block
    GateCase("rep2-d128-topk5", hq=4, hkv=2, dim=128, topk=5),  # topk padded to 8 slots in the kernel
    GateCase("rep16-d64-bf16", hq=16, hkv=1, dim=64, dtype=torch.bfloat16, lq=3),
    GateCase("rep2-d128-fp16", hq=4, hkv=2, dim=128, dtype=torch.float16),
    GateCase("rep1-d64-topk1", hq=2, hkv=2, dim=64, topk=1),
    GateCase("rep4-d96", hq=8, hkv=2, dim=96, lq=3),  # D padded to 128 in the kernels
    GateCase("rep4-d256-bf16", hq=4, hkv=1, dim=256, dtype=torch.bfloat16, lq=3),
    GateCase("rep2-d64-fp64", hq=4, hkv=2, dim=64, dtype=torch.float64),  # the reference only
]


@dataclass
class GateData:
    """One case's tensors: the scores' inputs (Q1, K, anchors, their gradient) and the gate's (scores,
    span outputs, the output's gradient)."""

    q1: torch.Tensor
    k: torch.Tensor
    anchors: torch.Tensor
    grad_scores: torch.Tensor
    scores: torch.Tensor
    span_out: torch.Tensor
    grad_out: torch.Tensor


def oracle_scores(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """v_j = Q1 . K[anchor_j] (EMPTY_GATE_SCORE for anchor -1) in float64, differentiable; an empty
    slot touches neither Q1 nor K."""
    q1, k = (t if t.dtype == torch.float64 else t.double() for t in (q1, k))
    rep = q1.shape[1] // k.shape[1]
    slots = anchors.tolist()
    scores = []
    for b, h, i in itertools.product(*map(range, anchors.shape[:3])):
        for anchor in slots[b][h][i]:
            scores.append(q1[b, h, i] @ k[b, h // rep, anchor] if anchor >= 0 else q1.new_tensor(EMPTY))
    return torch.stack(scores).view(anchors.shape)


def oracle_gate(scores: torch.Tensor, span_out: torch.Tensor) -> torch.Tensor:
    """O = sum_j softmax(v)_j O_j per row in float64, differentiable."""
    scores, span_out = (t if t.dtype == torch.float64 else t.double() for t in (scores, span_out))
    rows = []
    for b, h, i in itertools.product(*map(range, scores.shape[:3])):
        gate = torch.softmax(scores[b, h, i], 0)
        rows.append((gate[:, None] * span_out[b, h, i]).sum(0))
    return torch.stack(rows).view(*scores.shape[:3], -1)


def make_data(case: GateCase, gen: torch.Generator) -> GateData:
    """Anchors 1..Lkv-1 (key 0, every empty slot's stand-in row, is NaN), a quarter of the slots
    empty, the first row all empty with a NaN Q1 row; the gate's scores are the oracle's (fp32)."""
    b, hq, lq, d = case.batch, case.hq, case.lq, case.dim
    q1 = torch.randn(b, hq, lq, d, generator=gen).to(case.dtype)
    k = torch.randn(b, case.hkv, case.lkv, d, generator=gen).to(case.dtype)
    anchors = torch.randint(1, case.lkv, (b, hq, lq, case.topk), generator=gen)
    anchors[torch.rand(anchors.shape, generator=gen) < 0.25] = -1
    anchors[0, 0, 0] = -1
    q1[0, 0, 0] = float("nan")
    k[:, :, 0] = float("nan")
    scores = oracle_scores(q1, k, anchors).to(torch.float64 if case.dtype == torch.float64 else torch.float32)
    span_out = torch.randn(b, hq, lq, case.topk, d, generator=gen).to(case.dtype)
    return GateData(q1, k, anchors, torch.randn(anchors.shape, generator=gen, dtype=scores.dtype), scores, span_out,
                    torch.randn(b, hq, lq, d, generator=gen).to(case.dtype))


def check_data(case: GateCase, x: GateData) -> None:
    """The case really has empty slots, an all-empty row, key rows shared by several slots (dK sums them)
    and a partial last block of the largest declared row block (64)."""
    assert (x.anchors < 0).any() and (x.anchors >= 0).any() and bool((x.anchors[0, 0, 0] < 0).all())
    used = x.anchors[x.anchors >= 0]
    assert used.unique().numel() < used.numel(), "some key row must be shared"
    assert case.rows % 64, "the last block of 64 rows must be partial"


def configs(variant: Variant, problem: Problem) -> list[KernelConfig]:
    """The default and every corner of the declared space (each parameter at its least or greatest value)."""
    corners = [KernelConfig(dict(zip([p.name for p in variant.space], values)))
               for values in itertools.product(*((min(p.values), max(p.values)) for p in variant.space))]
    found = [variant.default(problem)] + [c for c in corners if c != variant.default(problem)]
    for config in found:
        assert variant.contains(config) and variant.compile_check(problem, config) is None, config.text()
    return found


def applicable(op: str, problem: Problem) -> list[tuple[Variant, KernelConfig]]:
    """Every (variant, configuration) of ``op`` to run on ``problem``; the Triton variant must apply
    unless the data are float64, which only the reference serves."""
    found = []
    for variant in REGISTRY.variants(op):
        reasons = variant.not_supported_reasons(problem)
        if reasons:
            assert variant.name == TRITON and problem.dtype == "float64" and "float64" in reasons[0], reasons
            continue
        found += [(variant, config) for config in configs(variant, problem)]
    assert found[-1][0] is REGISTRY.reference(op)
    return found


def assert_gradient(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, reduction: int, what: str) -> None:
    """``assert_close`` for a gradient; one the oracle gives as zero (one slot: a gate of 1) must be zero."""
    if not want.any():
        assert torch.equal(got, torch.zeros_like(got)), f"{what}: must be zero"
    else:
        assert_close(got, want, dtype, reduction, what, spread=GRADIENT_SPREAD)


def prefilled(variant: Variant, launch):
    """``launch()`` with every uninitialised allocation NaN-filled (the Triton launchers' outputs are)."""
    with nan_prefilled() as mode:
        result = launch()
    assert mode.filled or variant.name != TRITON, f"{variant.name}: no output was NaN-prefilled"
    return result


def assert_one_percent_fails(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, reduction: int,
                             spread: float = 1.0) -> None:
    """The comparison used here rejects ``got`` 1% too large."""
    with pytest.raises(AssertionError, match="scaled by|exceeds"):
        assert_close(got * 1.01, want, dtype, reduction, "1% too large", spread=spread)


def test_every_gate_op_has_a_triton_variant_then_its_reference() -> None:
    """Two variants per gate op, the declared space, and on a GPU a register check (D 256: 64 rows on
    1 warp spill; the default fits)."""
    for op in GATE_OPS:
        names = [v.name for v in REGISTRY.variants(op)]
        assert names == [TRITON, "reference"], names
        triton = REGISTRY.get(op, TRITON)
        assert {p.name: p.values for p in triton.space} == {"block_r": (8, 16, 32, 64), "num_warps": (1, 2, 4, 8)}
        assert REGISTRY.reference(op).space == ()
        h200 = REGISTRY.spec(op).canonical(
            Problem(op, "bfloat16", 256, 32, 2, 3, 64, 4096, 1, False, 0, "int2", DeviceIdentity("NVIDIA H200", "sm_90", 132)))
        assert triton.compile_check(h200, triton.default(h200)) is None
        assert "registers" in triton.compile_check(h200, KernelConfig(block_r=64, num_warps=1))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gate_scores_match_the_oracle(case: GateCase, gen: torch.Generator) -> None:
    x = make_data(case, gen)
    check_data(case, x)
    expected = oracle_scores(x.q1, x.k, x.anchors)
    used = x.anchors >= 0
    for variant, config in applicable(GATE_SCORES, REGISTRY.spec(GATE_SCORES).problem_of(x.q1, x.k, x.anchors)):
        what = f"{variant.name} {config.text()}"
        scores = prefilled(variant, lambda: variant.launch(x.q1, x.k, x.anchors, config))
        assert scores.dtype == (torch.float64 if case.dtype == torch.float64 else torch.float32), what
        assert torch.equal(scores[~used], torch.full_like(scores[~used], EMPTY)), f"{what}: empty slots score {EMPTY}"
        assert_close(scores[used], expected[used], case.dtype, case.dim, what)
    assert_one_percent_fails(scores[used], expected[used], case.dtype, case.dim)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gate_score_gradients_match_the_oracle(case: GateCase, gen: torch.Generator) -> None:
    x = make_data(case, gen)
    check_data(case, x)
    leaves = [t.detach().double().requires_grad_() for t in (x.q1, x.k)]
    expected = torch.autograd.grad(oracle_scores(*leaves, x.anchors), leaves, x.grad_scores.double())
    assert not any(torch.isnan(t).any() for t in expected), "the oracle reads no NaN"
    problem = REGISTRY.spec(GATE_SCORES_BACKWARD).problem_of(x.q1, x.k, x.anchors)
    for variant, config in applicable(GATE_SCORES_BACKWARD, problem):
        grads = prefilled(variant, lambda: variant.launch(x.q1, x.k, x.anchors, x.grad_scores, config))
        for name, got, want in zip(("dQ1", "dK"), grads, expected):
            what = f"{variant.name} {config.text()} {name}"
            assert got.dtype == case.dtype, what
            assert_gradient(got, want, case.dtype, case.topk * case.hq * case.lq, what)
    assert_one_percent_fails(grads[1], expected[1], case.dtype, case.topk * case.hq * case.lq, GRADIENT_SPREAD)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gate_matches_the_oracle(case: GateCase, gen: torch.Generator) -> None:
    x = make_data(case, gen)
    expected = oracle_gate(x.scores, x.span_out)
    for variant, config in applicable(GATE, REGISTRY.spec(GATE).problem_of(x.scores, x.span_out)):
        what = f"{variant.name} {config.text()}"
        out = prefilled(variant, lambda: variant.launch(x.scores, x.span_out, case.dtype, config))
        assert out.dtype == case.dtype, what
        assert_close(out, expected, case.dtype, case.topk, what)
    assert_one_percent_fails(out, expected, case.dtype, case.topk)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gate_gradients_match_the_oracle(case: GateCase, gen: torch.Generator) -> None:
    x = make_data(case, gen)
    leaves = [t.detach().double().requires_grad_() for t in (x.scores, x.span_out)]
    expected = torch.autograd.grad(oracle_gate(*leaves), leaves, x.grad_out.double())
    if case.topk > 1:
        assert expected[0].abs().max() > 1e-2, "the scores must get a gradient"
    for variant, config in applicable(GATE_BACKWARD, REGISTRY.spec(GATE_BACKWARD).problem_of(x.scores, x.span_out)):
        grads = prefilled(variant, lambda: variant.launch(x.scores, x.span_out, x.grad_out, config))
        for name, got, want, dtype in zip(("d scores", "d span_out"), grads, expected, (x.scores.dtype, case.dtype)):
            what = f"{variant.name} {config.text()} {name}"
            assert got.dtype == dtype, what
            assert_gradient(got, want, case.dtype, case.dim, what)
    assert_one_percent_fails(grads[1], expected[1], case.dtype, case.dim, GRADIENT_SPREAD)


# --- dispatch -----------------------------------------------------------------------------------


class Launches:
    """Every Triton kernel launched (under the interpreter): (kernel name, grid, constexpr/launch keywords)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple, dict]] = []

    def of(self, prefix: str) -> list[tuple[str, tuple, dict]]:
        return [launch for launch in self.seen if launch[0].startswith(prefix)]


@pytest.fixture
def launches(monkeypatch) -> Launches:
    record, run = Launches(), InterpretedFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        record.seen.append((self.fn.__name__, tuple(grid), kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", spy)
    return record


class GateOpsLayer:
    """A dispatcher layer holding one tuned choice for every gate op's key (none for other ops)."""

    name = "test gate entries"

    def __init__(self, config: KernelConfig) -> None:
        self.config = config

    def lookup(self, key, borrow: bool = False) -> LayerAnswer:
        if key.op in GATE_OPS and not borrow:
            return LayerAnswer(TunedChoice(TRITON, self.config), "hit")
        return LayerAnswer(None, "no entry")


LAYER_SETTINGS = dict(sw_index=1, topk=3, backward_factor=2.0, forward_factor=0.0, span_power=0.5, inv_search_power_int=2)


def layer_leaves(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Q1, Q2 [2, 4, 12, 16] and K, V [2, 2, 48, 16] leaves that require grad."""
    shapes = [(2, 4, 12, 16)] * 2 + [(2, 2, 48, 16)] * 2
    return [torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_() for shape in shapes]


def run_layer(leaves: list[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    """The public layer over the last 12 of 48 positions, forward and backward: (O, *gradients)."""
    out = superlinear_ops.superlinear_attention(*leaves, torch.arange(36, 48), None, **LAYER_SETTINGS)
    return [out.detach(), *torch.autograd.grad(out, leaves, torch.randn(out.shape, generator=gen))]


def test_the_gate_steps_run_the_dispatchers_choice(monkeypatch, gen: torch.Generator) -> None:
    """The Triton gate kernels on 16/32-bit data under the interpreter, the reference on float64 and on
    plain CPU tensors, each with its reason in ``explain``."""
    x = make_data(CASES[0], gen)
    problems = {GATE_SCORES: (x.q1, x.k, x.anchors), GATE_SCORES_BACKWARD: (x.q1, x.k, x.anchors),
                GATE: (x.scores, x.span_out), GATE_BACKWARD: (x.scores, x.span_out)}
    for op, tensors in problems.items():
        spec = REGISTRY.spec(op)
        assert dispatch.explain(spec.problem_of(*tensors)).choice.variant.name == TRITON, op
        wide = dispatch.explain(spec.problem_of(*(t.double() for t in tensors)))
        assert wide.choice.variant.name == "reference" and "float64" in dict(wide.variants)[TRITON][0], op
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for op, tensors in problems.items():
        plain = dispatch.explain(REGISTRY.spec(op).problem_of(*tensors))
        assert plain.choice.variant.name == "reference" and "TRITON_INTERPRET" in dict(plain.variants)[TRITON][0], op


def test_a_tuned_gate_configuration_reaches_the_kernels(launches: Launches, gen: torch.Generator) -> None:
    """With a tuned entry for every gate op (64 rows per program, 1 warp), the layer's four gate kernels
    launch with it, and the layer's numbers do not change."""
    leaves = layer_leaves(gen)
    default = run_layer(leaves, torch.Generator().manual_seed(1))
    kernels = {name for name, _, _ in launches.of("gate_")}
    assert kernels == {"gate_scores_kernel", "gate_scores_backward_kernel", "gate_forward_kernel", "gate_backward_kernel"}
    assert {(kw["BLOCK_R"], kw["num_warps"]) for _, _, kw in launches.of("gate_")} == {(16, 4)}, "the default: 16 rows, 4 warps"
    launches.seen.clear()
    dispatch.DISPATCHER.set_layers([GateOpsLayer(KernelConfig(block_r=64, num_warps=1))])
    tuned = run_layer(leaves, torch.Generator().manual_seed(1))
    seen = launches.of("gate_")
    assert {name for name, _, _ in seen} == kernels
    assert all(kw["BLOCK_R"] == 64 and kw["num_warps"] == 1 and grid == (2,) for _, grid, kw in seen), seen  # 96 rows
    for got, want in zip(tuned, default):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def layer_problem() -> Problem:
    return Problem("attention_layer", "float32", 16, 4, 2, 3, 12, 48, 2, False, 1, "int2", device_identity(CPU),
                   (2.0, 0.0, 0.5))


def test_explicit_gate_choices_run_as_given(launches: Launches) -> None:
    """The layer's candidate run (``attention_layer(..., gates=...)``) runs the gate it is given, not
    the dispatcher's: the reference launches no gate kernel, the Triton variant its configuration.
    Its gate scores are the search's (a forward: no gate-score kernel runs, whatever the choice)."""
    problem = layer_problem()
    x = runner.make_inputs(Case("layer", problem, problem.factors), CPU, seed=0)
    variant = REGISTRY.get("attention_layer", "reference")

    def layer(chosen: dict) -> torch.Tensor:
        parts = runner.resolve_parts(problem, chosen)
        launches.seen.clear()
        return runner.run(variant, KernelConfig(), problem, x, parts)[0]

    dispatched = layer({})
    assert {(name, kw["BLOCK_R"]) for name, _, kw in launches.of("gate_")} == {("gate_forward_kernel", 16)}
    torch.testing.assert_close(layer({"gate_scores": ("reference", {}), "gate": ("reference", {})}), dispatched)
    assert not launches.of("gate_"), "the reference gate launches no kernel"
    tiles = {"block_r": 8, "num_warps": 2}
    torch.testing.assert_close(layer({"gate_scores": (TRITON, tiles), "gate": (TRITON, tiles)}), dispatched)
    assert {(name, kw["BLOCK_R"], kw["num_warps"]) for name, _, kw in launches.of("gate_")} == {
        ("gate_forward_kernel", 8, 2)}


def test_the_layer_parts_are_the_keys_its_calls_look_up(gen: torch.Generator) -> None:
    """The layer spec's gate parts are exactly the problems its gate calls build from their tensors
    (so a tuned gate entry serves the layer), whatever the layer's mask, window and power."""
    problem = layer_problem()._replace(masked=True, sw_index=5, power="float0.55")
    parts = REGISTRY.spec("attention_layer").parts(problem)
    assert {name: part.op for name, part in parts.items()} == {"span": "span_forward", "gate_scores": GATE_SCORES, "gate": GATE}
    q1, k = torch.randn(2, 4, 12, 16, generator=gen), torch.randn(2, 2, 48, 16, generator=gen)
    anchors = torch.zeros(2, 4, 12, 3, dtype=torch.int64)
    span_out = torch.randn(2, 4, 12, 3, 16, generator=gen)
    assert key_of(parts["gate_scores"]) == key_of(REGISTRY.spec(GATE_SCORES).problem_of(q1, k, anchors))
    assert key_of(parts["gate"]) == key_of(REGISTRY.spec(GATE).problem_of(anchors.float(), span_out))
    for part in parts.values():
        part.check()
    with pytest.raises(ValueError, match="sw_index must be 0"):
        parts["gate"]._replace(sw_index=5).check()
    with pytest.raises(ValueError, match="keys must be 1"):
        parts["gate"]._replace(keys=48).check()


def test_the_layer_reference_run_is_pytorch_in_float64(launches: Launches) -> None:
    """``runner.reference_outputs`` of the layer gives every part (search, spans, gate scores, gate)
    its reference: no Triton kernel runs, and the result is float64; a candidate run launches the
    Triton gate kernel of its parts and takes its gate scores from the search (no gate-score kernel)."""
    problem = layer_problem()
    case = Case("layer", problem, problem.factors)
    x = runner.make_inputs(case, CPU, seed=0)
    launches.seen.clear()
    (out,) = runner.reference_outputs(problem, x)
    assert out.dtype == torch.float64 and not torch.isnan(out).any()
    assert not launches.seen, [name for name, _, _ in launches.seen]
    parts = runner.resolve_parts(problem)
    assert parts["gate_scores"][0].name == TRITON and parts["gate"][0].name == TRITON
    variant = REGISTRY.fallback(problem)
    (got,) = runner.run(variant, variant.default(problem), problem, x, parts)
    seen = {name for name, _, _ in launches.seen}
    assert "gate_forward_kernel" in seen and "gate_scores_kernel" not in seen, seen
    assert runner.relative_error((got,), (out,)) <= runner.tolerance(problem)


def test_warmup_resolves_every_gate_choice(gen: torch.Generator) -> None:
    """After ``warmup`` of the four gate problems, gate calls of their shape resolve no choice."""
    from superlinear_ops import torch_ops

    device = device_identity(CPU)
    problems = [REGISTRY.spec(op).canonical(Problem(op, "float32", 64, 4, 2, 3, 8, 32, 2, False, 0, "int2", device))
                for op in GATE_OPS]
    assert superlinear_ops.warmup(problems, "cpu") == 4
    before = dispatch.DISPATCHER.resolutions
    q1, k = torch.randn(2, 4, 8, 64, generator=gen), torch.randn(2, 2, 32, 64, generator=gen)
    anchors = torch.randint(-1, 32, (2, 4, 8, 3), generator=gen)
    scores = torch_ops.layer_gate_scores(q1, k, anchors)
    torch_ops.layer_gate_scores_backward(q1, k, anchors, torch.randn(scores.shape, generator=gen))
    span_out = torch.randn(2, 4, 8, 3, 64, generator=gen)
    torch_ops.layer_gate(scores, span_out, torch.float32)
    torch_ops.layer_gate_backward(scores, span_out, torch.randn(2, 4, 8, 64, generator=gen))
    assert dispatch.DISPATCHER.resolutions == before, "a gate choice was resolved after warm-up"


# --- the tuner and the CLI ----------------------------------------------------------------------


def scaled_first_output(variant: Variant, op: str) -> Variant:
    """``variant`` with its first output 1% too large (a candidate the checks must reject)."""

    def launch(*args):
        outputs = variant.launch(*args)
        return (outputs[0] * 1.01, *outputs[1:]) if isinstance(outputs, tuple) else outputs * 1.01

    return Variant(op=op, name="scaled", launch=launch, space=variant.space, reasons=variant.reasons,
                   compile_check=variant.compile_check, default=variant.default, priority=-1)


def empty_slots_score_zero(variant: Variant) -> Variant:
    """The gate scores with 0 for an empty slot instead of EMPTY_SCORE."""

    def launch(q1, k, anchors, config):
        return torch.where(anchors >= 0, variant.launch(q1, k, anchors, config), 0.0)

    return Variant(op=GATE_SCORES, name="empty_zero", launch=launch, space=variant.space, reasons=variant.reasons,
                   compile_check=variant.compile_check, default=variant.default, priority=-1)


@pytest.mark.parametrize("op", GATE_OPS)
def test_problem_bench_checks_and_times_every_gate_variant(op: str) -> None:
    """The tuner can tune each gate op: every variant at its default and corners passes the bench's
    checks (float64 reference, NaN-prefilled runs) and is timed; a 1% error is rejected."""
    spec = REGISTRY.spec(op)
    problem = spec.canonical(Problem(op, "float32", 64, 4, 2, 3, 8, 32, 2, False, 0, "int2", device_identity(CPU)))
    bench = ProblemBench(Case(f"{op} small", problem.check(), (2.0, 1.0, 0.5)), CPU, seed=0)
    for variant in REGISTRY.variants(op):
        for config in configs(variant, problem):
            assert bench.check(variant, config) <= runner.tolerance(problem), f"{variant.name} {config.text()}"
        assert bench.time_ms(variant, variant.default(problem)) > 0
    triton = REGISTRY.get(op, TRITON)
    wrong = [scaled_first_output(triton, op)] + ([empty_slots_score_zero(triton)] if op == GATE_SCORES else [])
    for variant in wrong:
        with pytest.raises(CandidateFailed, match="wrong result"):
            bench.check(variant, variant.default(problem))


@pytest.mark.parametrize("op", GATE_OPS)
def test_the_cli_lists_the_gate_variants(op: str, capsys) -> None:
    assert main(["variants", "--op", op]) == 0
    out = capsys.readouterr().out
    assert f"{op}/{TRITON}" in out and f"{op}/reference" in out
