"""``staged_decode``: one query per call, the search, its spans and the window (semantics section 3)."""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch
import torch.nn.functional as F

from ...problem import STAGED_DECODE, Problem
from ...settings import SpanSettings
from ..inputs import Inputs, decode_mask, random_inputs
from ..spec import DenseCalls, OpSpec, PublicOps, call_searching, grouped_heads
from .ideal_traffic import step_traffic


def decode_step(case, x: Inputs, fill: int | None, mask_kind: str | None, gen: torch.Generator) -> Inputs:
    """``x`` (decode inputs) at another fill of its static cache and another mask kind."""
    problem, lkv = case.problem, x.k.shape[2]
    filled = min(fill or lkv, lkv)
    kind = "prefix" if problem.masked and case.cache_fill is not None else mask_kind
    mask = decode_mask(kind, problem.batch, lkv, filled, x.k.device, gen)
    return replace(x, cache_position=torch.tensor([filled - 1], device=x.k.device), mask=mask)


class StagedDecode(OpSpec):
    """Decode: timed from a replayed CUDA graph, over every fill of a static cache and every mask kind
    of a masked context; dense SDPA over the filled prefix."""

    name = STAGED_DECODE
    searching = True
    single_query = True
    graph_timed = True

    def check(self, problem: Problem) -> None:
        if problem.queries != 1:
            raise ValueError(f"queries must be 1 for {self.name}, got {problem.queries}")

    def inputs(self, case, device, gen, queries, keys) -> Inputs:
        x = random_inputs(case.problem, case.span_factors, device, gen, queries, keys, random_mask=False)
        return decode_step(case, x, case.cache_fill, (case.mask_kinds or (None,))[0], gen)

    def variations(self, case, x: Inputs, gen, timed: bool) -> list[Inputs]:
        """Timed: every other (fill, mask kind) of the case. Checked: every other mask kind, and a
        masked problem's mask again as int64 (what Hugging Face passes; the kernels read 8-byte
        entries their own way) whose kept entries are 2**32, nonzero in the high word alone."""
        pairs = case.timed_inputs()[1:] if timed else [(None, kind) for kind in case.mask_kinds[1:]]
        steps = [decode_step(case, x, fill, kind, gen) for fill, kind in pairs]
        if not timed and x.mask is not None:
            steps.append(replace(x, mask=x.mask.to(torch.int64) << 32))
        return steps

    def run(self, variant, config, problem, x: Inputs, parts):
        return (variant.launch(x.q1, x.q, x.k, x.v, x.cache_position, x.mask, SpanSettings.of_problem(problem), config),)

    def traffic(self, case, timed) -> tuple[float, float]:
        """The mean over the timed inputs of what an ideal step moves and computes on them: each key a
        KV group attends read once for the group, whatever its heads choose (``ideal_traffic``)."""
        settings = SpanSettings.of_problem(case.problem)
        per_input = [step_traffic(x, settings) for x in timed]
        return statistics.fmean(b for b, _ in per_input), statistics.fmean(f for _, f in per_input)

    def dense(self, case, x: Inputs) -> DenseCalls:
        def decode_call(fill: int):
            def make(expand: bool):
                k, v = (t[:, :, :fill] for t in grouped_heads(x, expand))
                return lambda: F.scaled_dot_product_attention(x.q, k, v, enable_gqa=not expand)
            return make

        fills = [fill or case.problem.keys for fill in case.fills]
        return DenseCalls("decode over the filled prefix", tuple(decode_call(f) for f in fills), graph=True)

    def warmup(self, problem: Problem, device: torch.device, public: PublicOps) -> None:
        call_searching(public.decode_span_attention_staged_gqa, problem, device)
