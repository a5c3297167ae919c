"""Dispatcher: layer order, nearest buckets, memoisation, thread safety, explain, fallbacks."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import H200, problem

import superlinear_ops
from superlinear_ops import dispatch
from superlinear_ops.buckets import ProblemKey, key_of
from superlinear_ops.dispatch import HEURISTIC, Dispatcher, LayerAnswer, NoVariantError, TunedChoice
from superlinear_ops.launch import KernelConfig
from superlinear_ops.registry import REGISTRY, Variant


class DictLayer:
    """An in-memory layer that counts its lookups."""

    def __init__(self, name: str, entries: dict[ProblemKey, TunedChoice]) -> None:
        self.name = name
        self.entries = entries
        self.lookups = 0
        self._lock = threading.Lock()

    def lookup(self, key: ProblemKey, borrow: bool = False) -> LayerAnswer:
        with self._lock:
            self.lookups += 1
        choice = self.entries.get(key)
        return LayerAnswer(choice, "hit" if choice else "no entry")


TUNED = TunedChoice("per_query_span", KernelConfig(block_k=128, num_warps=8, num_stages=3))


def test_first_layer_with_a_hit_wins_in_order() -> None:
    p = problem()
    first = DictLayer("explicit", {})
    second = DictLayer("user", {key_of(p): TUNED})
    third = DictLayer("shipped", {key_of(p): TunedChoice("per_query_span", KernelConfig(block_k=16, num_warps=4, num_stages=2))})
    choice = Dispatcher(REGISTRY, [first, second, third]).select(p)
    assert (choice.variant.name, choice.config, choice.source) == ("per_query_span", TUNED.config, "user")
    assert third.lookups == 0 and first.lookups >= 1


def test_heuristic_default_when_no_layer_knows_the_key() -> None:
    p = problem()
    choice = Dispatcher(REGISTRY, [DictLayer("user", {})]).select(p)
    variant = REGISTRY.fallback(p)
    assert variant.name == "tc_tiles"
    assert (choice.variant, choice.config, choice.source) == (variant, variant.default(p), HEURISTIC)


def test_nearest_bucket_is_borrowed_within_distance() -> None:
    p = problem(keys=139000)  # bucket 262144
    neighbour = key_of(p)._replace(keys=131072)
    far = key_of(p)._replace(keys=32768)
    layer = DictLayer("shipped", {neighbour: TUNED, far: TunedChoice("per_query_span", KernelConfig(block_k=16, num_warps=4, num_stages=2))})
    choice = Dispatcher(REGISTRY, [layer]).select(p)
    assert choice.config == TUNED.config and "nearest bucket" in choice.source and "distance 1" in choice.source
    only_far = Dispatcher(REGISTRY, [DictLayer("shipped", {far: TUNED})]).select(p)
    assert only_far.source == HEURISTIC


def test_entries_that_do_not_apply_or_cannot_build_are_skipped() -> None:
    p = problem(op="span_backward", q_heads=8, kv_heads=8)  # rep 1: split variants do not apply
    bad_variant = TunedChoice("fused_split", KernelConfig(block_k=32, num_warps=4, num_stages=2))
    layer = DictLayer("user", {key_of(p): bad_variant})
    explanation = Dispatcher(REGISTRY, [layer]).explain(p)
    assert explanation.choice.source == HEURISTIC
    assert "does not apply" in dict(explanation.layers)["user"]
    big = problem(head_dim=256)
    layer = DictLayer("user", {key_of(big): TunedChoice("per_query_span", KernelConfig(block_k=256, num_warps=1, num_stages=1))})
    explanation = Dispatcher(REGISTRY, [layer]).explain(big)
    assert explanation.choice.source == HEURISTIC and "registers" in dict(explanation.layers)["user"]


def test_memoised_after_the_first_call_per_key() -> None:
    layer = DictLayer("user", {})
    dispatcher = Dispatcher(REGISTRY, [layer])
    problems = [problem(queries=n) for n in (5000, 8192, 100, 1)]
    for _ in range(3):
        for p in problems:
            dispatcher.select(p)
    assert dispatcher.resolutions == 3  # 5000 and 8192 share a bucket
    lookups = layer.lookups
    for p in problems * 10:
        dispatcher.select(p)
    assert layer.lookups == lookups and dispatcher.resolutions == 3
    dispatcher.set_layers([layer])
    dispatcher.select(problems[0])
    assert dispatcher.resolutions == 4


def test_thread_safe_each_key_resolved_once() -> None:
    layer = DictLayer("user", {key_of(problem(keys=1 << 12)): TUNED})
    dispatcher = Dispatcher(REGISTRY, [layer])
    problems = [problem(keys=1 << s) for s in range(10, 20)]
    results: list[list] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        results.append([dispatcher.select(p) for _ in range(200) for p in problems])

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert dispatcher.resolutions == len(problems)
    assert all(r == results[0] for r in results)
    assert results[0][2].config == TUNED.config


def test_explain_reports_variants_key_layers_and_choice() -> None:
    p = problem(op="span_backward", spans=1)
    text = Dispatcher(REGISTRY, [DictLayer("user", {})]).explain(p).text()
    assert key_of(p).text() in text
    assert "fused_split: not supported: K = 1 span slot" in text
    assert "user: miss (own key): no entry" in text
    assert "choice: span_backward/tc_tiles" in text and HEURISTIC in text


def test_no_applicable_variant_raises_with_every_reason() -> None:
    p = problem(op="span_backward", dtype="float64", queries=8192, keys=1 << 20)  # Triton: float64; reference: too big
    with pytest.raises(NoVariantError, match="float64.*materialise"):
        Dispatcher(REGISTRY).select(p)
    assert Dispatcher(REGISTRY).explain(p).choice is None


def test_block_k_forces_only_block_k() -> None:
    p = problem(op="staged_decode", queries=1, factors=(3.0, 1.0, 0.55))._replace(device=H200)
    chosen = dispatch.select(p, block_k=16)
    assert chosen.config.block_k == 16 and "forced" in chosen.source
    assert chosen.config.replace(block_k=0 + dispatch.select(p).config.block_k) == dispatch.select(p).config
    tiles = problem()._replace(device=H200)  # the tensor-core forward has no block_k: the hint is ignored
    assert dispatch.select(tiles, block_k=16) == dispatch.select(tiles)


def test_a_new_variant_is_one_registration(monkeypatch) -> None:
    base = REGISTRY.get("span_forward", "per_query_span")
    planted = Variant(**{**base.__dict__, "name": "planted_first", "priority": -1})
    REGISTRY.register(planted)
    try:
        dispatcher = Dispatcher(REGISTRY)
        assert dispatcher.select(problem()).variant.name == "planted_first"
        assert "planted_first" in [v.name for v in REGISTRY.variants("span_forward")]
    finally:
        REGISTRY.unregister("span_forward", "planted_first")


def test_public_api_goes_through_the_dispatcher(monkeypatch) -> None:
    seen = []
    original = dispatch.DISPATCHER.select

    def spy(p):
        seen.append(p.op)
        return original(p)

    monkeypatch.setattr(dispatch.DISPATCHER, "select", spy)
    q = torch.randn(1, 2, 1, 16)
    k = v = torch.randn(1, 2, 40, 16)
    superlinear_ops.decode_span_attention_staged_gqa(q, q, k, v, torch.tensor([39]), sw_index=2)
    spans = torch.full((1, 2, 1, 1), -1)
    superlinear_ops.fused_span_attention_gqa(q.requires_grad_(), k, v, spans, spans, torch.tensor([39]), None, 2).sum().backward()
    assert seen == ["staged_decode", "span_forward", "span_backward"]
