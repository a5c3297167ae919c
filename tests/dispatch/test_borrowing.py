"""The borrowing rule through real cache layers (a YAML file, a SQLite store): a neighbouring
bucket's entry serves only a problem of its kind (masked or not, full context or static cache), and
``explain`` names the rule that decided."""

from __future__ import annotations

import pytest
import torch
from cache_helpers import make_entry

from superlinear_ops.buckets import key_of
from superlinear_ops.cache import yaml_file
from superlinear_ops.cache.layers import context_of, layer_for, search_label
from superlinear_ops.cache.store import Store
from superlinear_ops.cli import main
from superlinear_ops.dispatch import FULL_CONTEXT, HEURISTIC, RULE_HEURISTIC, RULE_OWN, STATIC_CACHE, Dispatcher, TunedChoice
from superlinear_ops.launch import KernelConfig
from superlinear_ops.problem import STAGED_DECODE, Problem, device_identity
from superlinear_ops.registry import REGISTRY

# Model M's masked decode on this machine (what `superlinear-ops explain --mask --device cpu` builds).
DECODE = Problem(STAGED_DECODE, "bfloat16", 128, 32, 2, 3, 1, 65536, 1, True, 65, "float0.55",
                 device_identity(torch.device("cpu")), (3.0, 1.0, 0.55))
STATIC = KernelConfig(block_k=64, num_warps=4, num_stages=2, chunk=2048)  # a 131072-key cache tuned at a small fill
FULL = KernelConfig(block_k=64, num_warps=4, num_stages=3, chunk=512)


def entry(keys: int, config: KernelConfig, context: str):
    """A grouped-decode entry for DECODE at ``keys`` tuned on a problem of ``context`` kind."""
    return make_entry(key=key_of(DECODE._replace(keys=keys)), variant="grouped", config=config,
                      sampler=search_label("tpe", context))


@pytest.fixture
def static_only(tmp_path):
    """A YAML cache holding only the static-cache entry of the 131072-key bucket."""
    path = tmp_path / "static.yaml"
    yaml_file.write([entry(131072, STATIC, STATIC_CACHE)], path)
    return path


@pytest.fixture
def both_kinds(tmp_path):
    """A SQLite store with the static-cache entry at 131072 keys and a full-context one at 32768."""
    path = tmp_path / "both.sqlite"
    with Store.writer(path) as store:
        store.put(entry(131072, STATIC, STATIC_CACHE))
        store.put(entry(32768, FULL, FULL_CONTEXT))
    return path


def test_a_masked_full_context_never_takes_a_static_cache_neighbour(static_only) -> None:
    explanation = Dispatcher(REGISTRY, [layer_for(static_only)]).explain(DECODE)
    assert explanation.choice.source == HEURISTIC and explanation.rule == RULE_HEURISTIC, explanation.text()
    assert explanation.choice.config == REGISTRY.get(STAGED_DECODE, "grouped").default(DECODE)
    text = explanation.text()
    assert "Lkv131072" in text and "masked static cache problem is not borrowed for a masked full context" in text
    assert f"rule: {RULE_HEURISTIC}" in text


def test_a_same_kind_neighbour_is_still_borrowed(both_kinds) -> None:
    """The static-cache bucket (131072) is looked at first (same distance, sorted by key) and skipped."""
    explanation = Dispatcher(REGISTRY, [layer_for(both_kinds)]).explain(DECODE)
    assert explanation.choice.config == FULL, explanation.text()
    assert "Lkv32768" in explanation.choice.source
    assert explanation.rule == "nearest bucket of the same kind (masked full context, distance 1)"
    notes = [note for _, note in explanation.layers]
    assert any(n.startswith("skipped") and "Lkv131072" in n for n in notes[:-1]), notes
    assert notes[-1].startswith("hit") and "Lkv32768" in notes[-1], notes


def test_an_own_key_entry_serves_whatever_its_kind(both_kinds) -> None:
    """100,000 keys are in the static cache's own bucket: its entry serves (tuned over the fills up to full)."""
    explanation = Dispatcher(REGISTRY, [layer_for(both_kinds)]).explain(DECODE._replace(keys=100_000))
    assert explanation.choice.config == STATIC and explanation.rule == RULE_OWN, explanation.text()
    assert "(masked static cache entry)" in explanation.text()


def test_unmasked_problems_never_see_masked_entries(both_kinds) -> None:
    explanation = Dispatcher(REGISTRY, [layer_for(both_kinds)]).explain(DECODE._replace(masked=False))
    assert explanation.choice.source == HEURISTIC and "kind: unmasked full context" in explanation.text()


def test_the_kind_survives_yaml_and_store_round_trips(tmp_path, both_kinds) -> None:
    with Store.reader(both_kinds) as store:
        entries = sorted(store.entries(), key=lambda e: e.key.keys)
    assert [context_of(e) for e in entries] == [FULL_CONTEXT, STATIC_CACHE]
    yaml_file.write(entries, tmp_path / "export.yaml")
    assert [context_of(e) for e in sorted(yaml_file.read(tmp_path / "export.yaml"), key=lambda e: e.key.keys)] == [
        FULL_CONTEXT, STATIC_CACHE]


def test_explain_command_says_which_rule_decided(static_only, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SUPERLINEAR_OPS_CACHE", str(static_only))
    import superlinear_ops

    superlinear_ops.use_cache()
    assert main(["explain", "--keys", "65536", "--mask", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "kind: masked full context" in out and f"rule: {RULE_HEURISTIC}" in out
    assert main(["explain", "--keys", "100000", "--mask", "--device", "cpu"]) == 0
    assert f"rule: {RULE_OWN}" in capsys.readouterr().out


def test_unknown_contexts_are_refused() -> None:
    with pytest.raises(ValueError, match="context"):
        TunedChoice("grouped", FULL, "half full")
    with pytest.raises(ValueError, match="context"):
        search_label("tpe", "half full")
