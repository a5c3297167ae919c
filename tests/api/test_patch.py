"""patch_superlinear: the original ``superlinear`` 0.1.0 package's public functions, on every public
module that binds them, route to these ops (and unpatch_superlinear puts the originals back)."""

from __future__ import annotations

import importlib
import inspect
import logging
import sys

import pytest
import torch

import superlinear_ops
from superlinear_ops import api, dispatch, layer_api
from superlinear_ops.patch import patch_superlinear, unpatch_superlinear

pytest.importorskip(
    "superlinear.kernels.superlinear.attention.api",
    reason="the original package superlinear==0.1.0 is not installed (it is in the test extras, which CI installs)",
)
import superlinear  # noqa: E402  (the original, only once importorskip found it)

SPAN = "superlinear.kernels.superlinear.span"
ATTENTION = "superlinear.kernels.superlinear.attention"
SPAN_NAMES = (
    "fused_span_attention",
    "fused_span_attention_gqa",
    "span_attention",
    "span_attention_gqa",
    "decode_span_attention_staged",
    "decode_span_attention_staged_gqa",
    "decode_span_attention",
    "decode_span_attention_gqa",
)
LAYER_NAMES = (
    "prefill",
    "prefill_gqa",
    "prefill_mha",
    "fused_prefill_with_swtriton_gqa",
    "fused_prefill_with_swtriton",
    "fused_prefill_with_swtriton_bucketed_gqa",
)
STAGED = ("decode_span_attention_staged", "decode_span_attention_staged_gqa")  # re-exported by attention
# Where the 0.1.0 wheel binds each replaced name (its __init__ files and api modules).
BOUND = {
    f"{SPAN}.api": SPAN_NAMES,
    SPAN: SPAN_NAMES,
    f"{ATTENTION}.api": LAYER_NAMES + STAGED,
    ATTENTION: LAYER_NAMES + STAGED,
    "superlinear": (
        "fused_prefill_with_swtriton_gqa",
        "fused_prefill_with_swtriton_bucketed_gqa",
        "prefill",
        "prefill_gqa",
        "prefill_mha",
        *SPAN_NAMES[2:],  # all but fused_span_attention(_gqa)
    ),
}
# Public names patch_superlinear must leave alone (other paths, aliases that look their target up).
UNTOUCHED = {
    f"{ATTENTION}.api": ("build_sw_blockmask", "fused_prefill_with_swflex", "fused_prefill_with_swflex_gqa", "decode_attention_gqa"),
    ATTENTION: ("build_sw_blockmask", "prefill_bucketed_gqa", "full_span_attention_fused_with_search_values_gqa"),
    f"{SPAN}.api": ("create_span_mask", "compute_qend_from_qanchor"),
    "superlinear": ("span_search", "prefill_bucketed_gqa", "decode_attention_gqa", "window_len_from_sw_index"),
}
SW_INDEX, INV_POWER = 3, 2  # W = 15


def module(name: str):
    return importlib.import_module(name)


def snapshot(table: dict[str, tuple[str, ...]]) -> dict[str, object]:
    """The current object bound at every "module.name" of ``table``."""
    return {f"{m}.{n}": getattr(module(m), n) for m, names in table.items() for n in names}


ORIGINALS = snapshot(BOUND)  # taken at import, before any test patched anything


@pytest.fixture(autouse=True)
def always_unpatched():
    """Every test starts and ends with the original's own functions in place."""
    unpatch_superlinear()
    yield
    unpatch_superlinear()


@pytest.fixture
def select_calls(monkeypatch) -> list:
    """The problems the dispatcher is asked about (a spy around dispatch.select)."""
    calls = []
    real = dispatch.select

    def spy(problem, block_k=None):
        calls.append(problem)
        return real(problem, block_k)

    monkeypatch.setattr(dispatch, "select", spy)
    return calls


def test_span_functions_are_replaced_where_the_original_binds_them(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="superlinear_ops"):
        replaced = patch_superlinear()
    import superlinear.kernels.superlinear.span.api as original_span_api

    assert original_span_api.fused_span_attention_gqa is superlinear_ops.api.fused_span_attention_gqa
    for module_name in (f"{SPAN}.api", SPAN):
        for name in SPAN_NAMES:
            assert getattr(module(module_name), name) is getattr(api, name), f"{module_name}.{name}"
            assert replaced[f"{module_name}.{name}"] == f"superlinear_ops.api.{name}"
    assert superlinear.span_attention_gqa is api.span_attention_gqa
    [record] = [r for r in caplog.records if r.name == "superlinear_ops" and r.levelno == logging.INFO]
    assert f"{SPAN}.api.fused_span_attention_gqa -> superlinear_ops.api.fused_span_attention_gqa" in record.getMessage()


def test_layer_functions_are_replaced_where_the_original_binds_them() -> None:
    replaced = patch_superlinear()
    layer_api = importlib.import_module("superlinear_ops.layer_api")

    assert superlinear.kernels.superlinear.attention.prefill is layer_api.prefill
    for module_name in (f"{ATTENTION}.api", ATTENTION):
        for name in LAYER_NAMES:
            assert getattr(module(module_name), name) is getattr(layer_api, name), f"{module_name}.{name}"
            assert replaced[f"{module_name}.{name}"] == f"superlinear_ops.layer_api.{name}"
        for name in STAGED:  # the decode names attention re-exports are the span API's
            assert getattr(module(module_name), name) is getattr(api, name), f"{module_name}.{name}"
            assert replaced[f"{module_name}.{name}"] == f"superlinear_ops.api.{name}"
    assert superlinear.fused_prefill_with_swtriton_gqa is layer_api.fused_prefill_with_swtriton_gqa


def test_exactly_the_public_bindings_are_replaced() -> None:
    untouched = snapshot(UNTOUCHED)
    replaced = patch_superlinear()
    layer_api = importlib.import_module("superlinear_ops.layer_api")

    ours = {name: f"superlinear_ops.api.{name}" for name in SPAN_NAMES}
    ours |= {name: f"superlinear_ops.layer_api.{name}" for name in LAYER_NAMES}
    assert replaced == {f"{m}.{n}": ours[n] for m, names in BOUND.items() for n in names}
    for key in replaced:
        module_name, name = key.rsplit(".", 1)
        assert getattr(module(module_name), name) is getattr(layer_api if name in LAYER_NAMES else api, name), key
    assert snapshot(UNTOUCHED) == untouched


def span_inputs() -> tuple:
    """B 1, Hq 2, Hkv 1, Lq 4, Lkv 32, D 16, two span slots ending before the window (W = 15)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 16, generator=gen)
    k, v = (torch.randn(1, 1, 32, 16, generator=gen) for _ in range(2))
    qstart = torch.tensor([0, 7]).expand(1, 2, 4, 2).clone()
    qend = torch.tensor([6, 13]).expand(1, 2, 4, 2).clone()  # the first window starts at 28 - 15 + 1 = 14
    qstart[0, 1, :, 0] = 3  # a shorter span for the second head
    qstart[0, 0, 3, 1] = qend[0, 0, 3, 1] = -1  # an unused slot
    return q, k, v, qstart, qend, torch.arange(28, 32)


def test_span_call_through_the_original_import_path_reaches_our_dispatcher(select_calls) -> None:
    patch_superlinear()
    import superlinear.kernels.superlinear.span.api as original_span_api

    inputs = span_inputs()
    out = original_span_api.fused_span_attention_gqa(*inputs, None, SW_INDEX, inv_search_power_int=INV_POWER)
    assert select_calls, "the call through superlinear's span API did not reach superlinear_ops.dispatch.select"
    expected = superlinear_ops.api.fused_span_attention_gqa(*inputs, None, SW_INDEX, inv_search_power_int=INV_POWER, validate=True)
    assert out.shape == (1, 2, 4, 2, 16)
    assert torch.equal(out, expected)


def test_decode_call_through_the_original_attention_package_reaches_our_dispatcher(select_calls) -> None:
    patch_superlinear()
    gen = torch.Generator().manual_seed(1)
    q1, q2 = (torch.randn(1, 2, 1, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 1, 32, 16, generator=gen) for _ in range(2))
    args = (q1, q2, k, v, torch.tensor([31]), None, SW_INDEX, 2)  # position 31, topk 2

    out = superlinear.kernels.superlinear.attention.decode_span_attention_staged_gqa(*args, inv_search_power_int=INV_POWER)
    assert select_calls, "the call through superlinear's attention package did not reach superlinear_ops.dispatch.select"
    expected = superlinear_ops.api.decode_span_attention_staged_gqa(*args, inv_search_power_int=INV_POWER)
    assert out.shape == (1, 2, 1, 16)
    assert torch.equal(out, expected)
    # The original's own alias looks decode_span_attention_staged_gqa up at call time: ours too.
    calls = len(select_calls)
    alias = superlinear.kernels.superlinear.attention.decode_attention_gqa(*args, inv_search_power_int=INV_POWER)
    assert len(select_calls) > calls
    assert torch.equal(alias, expected)


def test_prefill_call_through_the_original_attention_package_reaches_our_layer(select_calls) -> None:
    patch_superlinear()
    gen = torch.Generator().manual_seed(2)
    q1, q2 = (torch.randn(1, 2, 6, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 1, 40, 16, generator=gen) for _ in range(2))
    positions = torch.arange(34, 40)  # a chunk over a cached prefix, t > W = 15: stripes exist

    out = superlinear.kernels.superlinear.attention.fused_prefill_with_swtriton_gqa(
        q1, q2, k, v, positions, None, SW_INDEX, 2, inv_search_power_int=INV_POWER, forward_factor=1.0,
    )
    assert any(problem.op == "attention_layer" for problem in select_calls), "the prefill call did not reach the layer's dispatch"
    expected = superlinear_ops.superlinear_attention(q1, q2, k, v, positions, None, SW_INDEX, 2, forward_factor=1.0,
                                                     inv_search_power_int=INV_POWER)
    assert out.shape == (1, 2, 6, 16)
    assert torch.equal(out, expected)


def test_patching_twice_is_harmless_and_unpatch_restores_the_originals() -> None:
    first = patch_superlinear()
    second = patch_superlinear()
    assert second == first
    assert unpatch_superlinear() == list(first)
    assert all(snapshot(BOUND)[key] is original for key, original in ORIGINALS.items())
    assert unpatch_superlinear() == []


def test_nothing_is_patched_when_the_original_is_not_installed(monkeypatch, caplog) -> None:
    for name in [m for m in sys.modules if m == "superlinear" or m.startswith("superlinear.")]:
        monkeypatch.setitem(sys.modules, name, None)  # "import superlinear" now fails as if absent
    with caplog.at_level(logging.INFO, logger="superlinear_ops"):
        assert patch_superlinear() == {}
    assert "not installed" in caplog.text
    monkeypatch.undo()
    assert all(snapshot(BOUND)[key] is original for key, original in ORIGINALS.items())


def test_nothing_is_patched_when_the_original_cannot_be_imported(monkeypatch, caplog) -> None:
    for name in [m for m in sys.modules if m == "superlinear" or m.startswith("superlinear.")]:
        monkeypatch.delitem(sys.modules, name)  # a fresh import of the original ...
    monkeypatch.setitem(sys.modules, "triton", None)  # ... that fails on its Triton import
    with caplog.at_level(logging.INFO, logger="superlinear_ops"):
        assert patch_superlinear() == {}
    assert "cannot be imported" in caplog.text and "triton" in caplog.text
    monkeypatch.undo()
    assert all(snapshot(BOUND)[key] is original for key, original in ORIGINALS.items())


# The original's (*args, **kwargs) forwarders and the function whose signature each takes.
FORWARDED = {
    "span_attention": (f"{SPAN}.api", "fused_span_attention"),
    "span_attention_gqa": (f"{SPAN}.api", "fused_span_attention_gqa"),
    "decode_span_attention": (f"{SPAN}.api", "decode_span_attention_staged"),
    "decode_span_attention_gqa": (f"{SPAN}.api", "decode_span_attention_staged_gqa"),
    "prefill_gqa": (f"{ATTENTION}.api", "fused_prefill_with_swtriton_gqa"),
    "fused_prefill_with_swtriton": (f"{ATTENTION}._prefill", "fused_prefill_with_swtriton"),
}


def _original_signature(name: str) -> inspect.Signature:
    function = ORIGINALS[f"{SPAN if name in SPAN_NAMES else ATTENTION}.api.{name}"]
    if name in FORWARDED:
        assert "args" in inspect.signature(function).parameters, f"{name} is no longer a forwarder"
        home, target = FORWARDED[name]
        function = getattr(module(home), target)
    return inspect.signature(function)


# Where ours differs from the original on purpose: a positional parameter under another name (ours also takes the
# original's name as a keyword), and tile hints whose defaults differ (ours are ignored hints).
RENAMED_POSITIONAL = {("fused_prefill_with_swtriton", "topk"): "num_spans"}
HINT_DEFAULTS = {"block_k"}


@pytest.mark.parametrize("name", SPAN_NAMES + LAYER_NAMES)
def test_every_call_the_original_accepts_binds_to_ours(name: str) -> None:
    """For every replaced public name (forwarders resolved to the function they call): each of the
    original's positional parameters sits at the same position in ours under the same name (or its
    declared rename), each of its parameter names (keyword-only ones included) is a keyword ours
    accepts, each of its defaults is ours (tile hints aside), and ours requires nothing more."""
    theirs = _original_signature(name)
    ours = inspect.signature(getattr(api if name in SPAN_NAMES else layer_api, name))
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    our_positional = [p for p in ours.parameters.values() if p.kind in positional]
    keywords = {p.name for p in ours.parameters.values() if p.kind != inspect.Parameter.POSITIONAL_ONLY}
    for index, param in enumerate(theirs.parameters.values()):
        if param.kind in positional:
            assert index < len(our_positional), f"{name}: positional {param.name!r} (#{index}) has no place in ours"
            expected = RENAMED_POSITIONAL.get((name, param.name), param.name)
            assert our_positional[index].name == expected, (
                f"{name}: positional #{index} is {param.name!r} in the original, {our_positional[index].name!r} in ours")
        assert param.name in keywords or param.kind == inspect.Parameter.POSITIONAL_ONLY, (
            f"{name}: the original's {param.name!r} is not a keyword of ours")
        if param.default is not inspect.Parameter.empty and param.name not in HINT_DEFAULTS:
            assert ours.parameters[param.name].default == param.default, (
                f"{name}: {param.name!r} defaults to {param.default!r} in the original, "
                f"{ours.parameters[param.name].default!r} in ours")
    required = {p.name for p in ours.parameters.values() if p.default is inspect.Parameter.empty}
    theirs_required = {RENAMED_POSITIONAL.get((name, p.name), p.name) for p in theirs.parameters.values()
                       if p.default is inspect.Parameter.empty}
    assert required <= theirs_required, f"{name}: ours requires {sorted(required - theirs_required)}, the original does not"


HELPERS = {  # the original's helpers that superlinear_ops re-exports, and the wheel module that defines each
    "window_len_from_sw_index": "superlinear.kernels.common.power",
    "max_stripe_index_for_token_pos": "superlinear.kernels.common.power",
    "compute_qend_from_qanchor": "superlinear.kernels.common.adjustment",
}
POWERS = ({"search_power": None, "inv_search_power_int": 2}, {"search_power": 0.55, "inv_search_power_int": None},
          {"search_power": None, "inv_search_power_int": 3}, {"search_power": 0.5, "inv_search_power_int": None})


@pytest.mark.parametrize("name", sorted(HELPERS))
def test_reexported_helpers_take_the_originals_arguments(name: str) -> None:
    """Each of the original's parameters is one of ours of the same kind, with the original's default
    where it has one (ours may default what it requires), and ours requires nothing more."""
    theirs = inspect.signature(getattr(module(HELPERS[name]), name)).parameters
    ours = inspect.signature(getattr(superlinear_ops, name)).parameters
    assert list(theirs) == list(ours), f"{name}: parameters {list(theirs)} in the original, {list(ours)} in ours"
    for param in theirs.values():
        assert ours[param.name].kind == param.kind, f"{name}: {param.name!r} is {ours[param.name].kind} in ours"
        if param.default is not inspect.Parameter.empty:
            assert ours[param.name].default == param.default, f"{name}: {param.name!r}'s default"


def test_reexported_helpers_give_the_originals_values() -> None:
    """The stripe and window helpers over positions and both power paths, and the span ends from anchors
    (masked rows and forward factors included), equal the original's."""
    power, adjustment = module(HELPERS["window_len_from_sw_index"]), module(HELPERS["compute_qend_from_qanchor"])
    for kwargs in POWERS:
        for sw_index in (0, 1, 2, 44, 65):
            assert superlinear_ops.window_len_from_sw_index(sw_index, **kwargs) == power.window_len_from_sw_index(
                sw_index, **kwargs), (sw_index, kwargs)
        for pos in [*range(0, 300), 4095, 65535, 1 << 20]:
            assert superlinear_ops.max_stripe_index_for_token_pos(pos, **kwargs) == \
                power.max_stripe_index_for_token_pos(pos, **kwargs), (pos, kwargs)
    gen = torch.Generator().manual_seed(5)
    lkv, lq = 96, 12
    cache_position = torch.arange(lkv - lq, lkv)
    qanchor = torch.randint(-1, lkv - lq, (2, 4, lq, 3), generator=gen)
    mask = torch.ones(2, lkv, dtype=torch.int64)
    mask[1, :17] = 0
    mask[:, 40] = 0
    for kwargs in POWERS[:2]:
        for extra in ({}, {"attention_mask": mask, "forward_factor": 1.0, "sw_index": 2, "span_power": 0.55}):
            args = dict(cache_position=cache_position, key_length=lkv, **kwargs, **extra)
            ours = superlinear_ops.compute_qend_from_qanchor(qanchor, **args)
            theirs = adjustment.compute_qend_from_qanchor(qanchor, **args)
            assert torch.equal(ours, theirs), (kwargs, sorted(extra))
