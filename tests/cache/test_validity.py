"""Variant-declared tunables, entry validity that follows the code a variant runs, borrowing across
GPUs of one architecture, and rules that read only what a key holds."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from cache_helpers import make_entry

from superlinear_ops.buckets import key_of
from superlinear_ops.cache import yaml_file
from superlinear_ops.cache.layers import YamlLayer
from superlinear_ops.cache.store import Store
from superlinear_ops.cache.validity import why_unusable
from superlinear_ops.dispatch import HEURISTIC, Dispatcher
from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.span_attention import variants as span_variants
from superlinear_ops.problem import DeviceIdentity, Problem
from superlinear_ops.registry import REGISTRY, Registry
from superlinear_ops.tuner.search import candidate_of, params_of

ROOT = pathlib.Path(__file__).resolve().parents[2]
H200 = DeviceIdentity("NVIDIA H200", "sm_90", 132)
H100 = DeviceIdentity("NVIDIA H100 80GB HBM3", "sm_90", 132)
A100 = DeviceIdentity("NVIDIA A100-SXM4-80GB", "sm_80", 108)
GROUPED = REGISTRY.get("staged_decode", "grouped")


def decode_problem(device: DeviceIdentity = H200, keys: int = 65536) -> Problem:
    return Problem("staged_decode", "bfloat16", 128, 32, 2, 3, 1, keys, 1, False, 65, "float0.55", device, (3.0, 1.0, 0.55))


# --- named tunables -----------------------------------------------------------------------------


def test_config_is_an_immutable_named_mapping() -> None:
    config = KernelConfig(block_k=64, num_warps=4, num_stages=3, chunk=512)
    assert dict(config) == {"block_k": 64, "chunk": 512, "num_stages": 3, "num_warps": 4}
    assert config.chunk == config["chunk"] == 512 and config.text() == "block_k=64 chunk=512 num_stages=3 num_warps=4"
    assert config.replace(chunk=256).chunk == 256 and config.chunk == 512
    with pytest.raises(AttributeError):
        config.chunk = 1
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        KernelConfig(chunk=0)
    with pytest.raises(AttributeError, match="no parameter 'bogus'"):
        _ = config.bogus


def test_grouped_decode_tunes_its_chunk_length() -> None:
    names = [p.name for p in GROUPED.space]
    assert "chunk" in names
    default = GROUPED.default(decode_problem())
    assert GROUPED.contains(default) and default.chunk in dict((p.name, p.values) for p in GROUPED.space)["chunk"]
    chunks = {c.chunk for c in GROUPED.configs()}
    assert chunks == {128, 192, 256, 384, 448, 512, 768, 896, 1024, 1536, 2048, 3072, 4096}, f"chunk values {sorted(chunks)}"
    name, config = candidate_of(params_of(GROUPED, default))  # the tuner's trial parameters round-trip
    assert (name, config) == ("grouped", default)


def test_a_config_must_hold_exactly_the_variants_names() -> None:
    forward = REGISTRY.get("span_forward", "per_query_span")
    assert forward.violation(KernelConfig(block_k=64, num_warps=4, num_stages=2)) is None
    assert "not this variant's" in forward.violation(KernelConfig(block_k=64, num_warps=4))
    assert "not this variant's" in forward.violation(KernelConfig(block_k=64, num_warps=4, num_stages=2, chunk=128))
    assert "num_warps=3 is not one of" in forward.violation(KernelConfig(block_k=64, num_warps=3, num_stages=2))


def test_named_parameters_round_trip_through_yaml_and_sqlite(tmp_path) -> None:
    key = key_of(decode_problem(DeviceIdentity("cpu", "interpreter", 0)))
    entry = make_entry(0, key=key, variant="grouped", config=KernelConfig(block_k=64, num_warps=4, num_stages=2, chunk=256))
    yaml_file.write([entry], tmp_path / "e.yaml")
    assert "chunk: 256" in (tmp_path / "e.yaml").read_text()
    (back,) = yaml_file.read(tmp_path / "e.yaml")
    with Store.writer(tmp_path / "s.sqlite") as store:
        store.put(back)
        (stored,) = store.entries()
    assert stored == entry and stored.config.chunk == 256
    assert why_unusable(stored) is None


def test_an_entry_from_before_a_new_tunable_is_ignored_with_a_reason() -> None:
    """An old grouped entry (no chunk) is never misread as a configuration of today's variant."""
    key = key_of(decode_problem(DeviceIdentity("cpu", "interpreter", 0)))
    old = make_entry(0, key=key, variant="grouped", config=KernelConfig(block_k=64, num_warps=4, num_stages=3))
    assert "outside the variant's declared space" in why_unusable(old)


# --- validity follows the code that runs ---------------------------------------------------------

_HASHES = (
    "import json, superlinear_ops; from superlinear_ops.registry import REGISTRY;"
    "print(json.dumps({v.qualified_name: v.code_hash for v in REGISTRY.all()}))"
)


def _hashes(package_root: pathlib.Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(package_root), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _HASHES], env=env, cwd=package_root, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _edit(path: pathlib.Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def test_hash_ignores_comments_and_docstrings_and_follows_code(tmp_path) -> None:
    shutil.copytree(ROOT / "superlinear_ops", tmp_path / "superlinear_ops", ignore=shutil.ignore_patterns("__pycache__"))
    package = tmp_path / "superlinear_ops"
    before = _hashes(tmp_path)
    assert before == {v.qualified_name: v.code_hash for v in REGISTRY.all()}  # stable across processes

    # Cosmetic edits: a docstring of a Triton helper, a comment inside a kernel, a launcher's docstring.
    _edit(package / "ops" / "kernel_helpers.py", '"""[lo, hi] of the sliding window', '"""The [lo, hi] bounds of the sliding window')
    _edit(package / "ops" / "span_attention" / "per_query_backward.py", "    dq = tl.zeros((BLOCK_D,), dtype=tl.float32)\n",
          "    # accumulated over every span and the window\n    dq = tl.zeros((BLOCK_D,), dtype=tl.float32)\n")
    _edit(package / "launch.py", '"""Lay validated inputs out for the kernels', '"""Lay the validated inputs out for the kernels')
    assert _hashes(tmp_path) == before

    # A real change in the backward kernel: exactly the Triton backward variants change.
    _edit(package / "ops" / "span_attention" / "per_query_backward.py", "tl.store(dq_ptrs, dq * sm_scale, mask=d_mask)",
          "tl.store(dq_ptrs, dq * sm_scale * 1.0, mask=d_mask)")
    after = _hashes(tmp_path)
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {v.qualified_name for v in REGISTRY.variants("span_backward") if v.baseline}


def test_hash_follows_the_code_not_where_it_lives(tmp_path) -> None:
    """Moving shared kernel helpers to a module of another name (every import rewritten) changes no
    variant's hash; a real change in a moved helper still changes the hashes of the variants that use it."""
    package = tmp_path / "superlinear_ops"
    shutil.copytree(ROOT / "superlinear_ops", package, ignore=shutil.ignore_patterns("__pycache__"))
    before = _hashes(tmp_path)
    helpers = package / "ops" / "kernel_helpers.py"
    moved = package / "shared_tile_helpers.py"
    moved.write_text(helpers.read_text())
    helpers.unlink()
    for path in package.rglob("*.py"):
        text = path.read_text()
        edited = re.sub(r"from (\.+)kernel_helpers import", lambda m: f"from {m.group(1)}.shared_tile_helpers import", text)
        if edited != text:
            path.write_text(edited)
    assert _hashes(tmp_path) == before

    _edit(moved, "        out = tl.dot(a, b, input_precision=\"ieee\")\n", "        out = tl.dot(a, b, input_precision=\"ieee\") * 1.0\n")
    changed = {name for name, value in _hashes(tmp_path).items() if value != before[name]}
    assert "span_forward/tc_tiles" in changed and "attention_layer/stripe_tiles" in changed
    assert "span_forward/per_query_span" not in changed  # it never calls tc_dot


# --- borrowing across GPUs of one architecture ------------------------------------------------------


def _tuned_on_h200(problem: Problem, tmp_path) -> pathlib.Path:
    config = GROUPED.default(problem).replace(num_stages=2)
    entry = make_entry(0, key=key_of(problem), variant="grouped", config=config,
                       provenance={"gpu_name": H200.name, "compute_capability": "sm_90", "interpreter": False})
    yaml_file.write([entry], tmp_path / "h200.yaml")
    return tmp_path / "h200.yaml"


def test_another_gpu_of_the_architecture_borrows_the_entry(tmp_path) -> None:
    path = _tuned_on_h200(decode_problem(H200), tmp_path)
    dispatcher = Dispatcher(REGISTRY, [YamlLayer("shipped", lambda: [path], str(path))])
    own = dispatcher.explain(decode_problem(H200))
    assert own.choice.source == "shipped" and own.choice.config.num_stages == 2

    borrowed = dispatcher.explain(decode_problem(H100))
    assert borrowed.choice.source == "shipped, borrowed from NVIDIA H200", borrowed.text()
    assert borrowed.choice.config == own.choice.config
    assert "borrowed from NVIDIA H200" in borrowed.text()

    other_arch = dispatcher.explain(decode_problem(A100))
    assert other_arch.choice.source == HEURISTIC


# --- rules read only what the key holds ---------------------------------------------------------


def test_problems_of_one_bucket_get_one_answer_on_either_side_of_a_limit(monkeypatch) -> None:
    """The split dK/dV budget reads Lkv: 40,000 and 60,000 keys share a bucket (65,536) but straddle
    a budget of 50,000 keys' buffers. Whatever comes first, both get the same (conservative) answer."""
    small = Problem("span_backward", "bfloat16", 128, 32, 2, 3, 4096, 40_000, 1, False, 65, "float0.55", H200)
    large = small._replace(keys=60_000)
    assert key_of(small) == key_of(large)
    per_key = 2 * 32 * 128 * 4
    monkeypatch.setattr(span_variants, "SPLIT_DKV_BUDGET_BYTES", 50_000 * per_key)
    per_query = Registry()  # the variants whose rule reads the budget
    per_query.add_op(REGISTRY.spec("span_backward"))
    for variant in REGISTRY.variants("span_backward"):
        if variant.baseline:
            per_query.register(variant)
    answers = set()
    for order in ((small, large), (large, small)):
        dispatcher = Dispatcher(per_query, [])
        answers.add(tuple(dispatcher.select(p).variant.name for p in order))
    assert answers == {("fused_shared", "fused_shared")}


@pytest.mark.parametrize("field,value,match", [
    ("dtype", "int8", "dtype must be one of"),
    ("head_dim", 0, "head_dim must be a positive int"),
    ("head_dim", 512, "head_dim must be at most 256"),
    ("kv_heads", 0, "kv_heads must be a positive int"),
    ("power", "bogus", "power label"),
    ("keys", -5, "keys must be a positive int"),
    ("device", None, "device must be a DeviceIdentity"),
    ("factors", (3.0,), "factors must be"),
    ("factors", (3.0, 1.0, float("nan")), "span_power must be a finite number"),
])
def test_select_and_explain_check_every_field(field, value, match) -> None:
    bad = decode_problem()._replace(**{field: value})
    dispatcher = Dispatcher(REGISTRY, [])
    with pytest.raises((ValueError, TypeError), match=match):
        dispatcher.select(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        dispatcher.explain(bad)
