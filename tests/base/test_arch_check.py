"""Per-architecture checks: limits, the shipped compiled table (coverage, freshness, a sample compiled
for real), and their effect on the registry's reasons, the tuner's compile check and ``explain``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from helpers import LaunchSpy

from superlinear_ops import arch_check
from superlinear_ops.arch_check import ARCH_LIMITS, Resources, compiled_reason, shipped_table, summary, use_table
from superlinear_ops.arch_compile import config_key, covered, generate, part_values
from superlinear_ops.buckets import key_of
from superlinear_ops.cli import main
from superlinear_ops.dispatch import Dispatcher, LayerAnswer, TunedChoice
from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.rules import SHARED_MEMORY_BYTES
from superlinear_ops.problem import SPAN_FORWARD, DeviceIdentity, Problem
from superlinear_ops.registry import REGISTRY

A100 = DeviceIdentity("NVIDIA A100", "sm_80", 108)
FORWARD = REGISTRY.get("span_forward", "tc_tiles")
SMALL = dict(window_block_m=32, window_block_n=16, window_warps=4, window_stages=2,
             span_block_m=32, span_block_n=16, span_warps=4, span_stages=2)


def problem(device: DeviceIdentity, op: str = SPAN_FORWARD, dtype: str = "bfloat16", head_dim: int = 128) -> Problem:
    """Model M's 8192-query prefill chunk over 139,264 keys on ``device``."""
    return Problem(op, dtype, head_dim, 32, 2, 3, 8192, 139264, 1, False, 65, "float0.55", device)


def gpu(arch: str) -> DeviceIdentity:
    return DeviceIdentity(f"a GPU of {arch}", arch, 100)


@pytest.fixture
def planted():
    """A table (forward only) whose sm_80 window tiles 64/64/4/2 need more shared memory than sm_80 has."""
    parts = {}
    for part, specs in covered()["span_forward/tc_tiles"].items():
        results = {key: [[20000, 128, 0, 0, 128]] * len(specs) for key in map(config_key, part_values("span_forward/tc_tiles", part))}
        parts[part] = {"kernels": [s.name for s in specs], "results": {"sm_80": dict(results), "sm_90": dict(results)}}
    parts["window"]["results"]["sm_80"]["64/64/4/2"] = [[170000, 128, 0, 0, 128]]
    table = {"format": arch_check.TABLE_FORMAT, "key": "16bit/d128", "archs": ["sm_80", "sm_90"],
             "variants": {"span_forward/tc_tiles": {"code_hash": FORWARD.code_hash, "parts": parts}}}
    use_table(table)
    yield table
    use_table(None)


def test_limits_are_the_six_archs_and_agree_with_the_static_estimates() -> None:
    assert set(ARCH_LIMITS) == {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"}
    for arch, limits in ARCH_LIMITS.items():
        assert limits.shared_bytes == SHARED_MEMORY_BYTES[arch]
    assert ARCH_LIMITS["sm_80"].shared_bytes == 163 * 1024 and ARCH_LIMITS["sm_86"].shared_bytes == 99 * 1024
    assert ARCH_LIMITS["sm_90"].shared_bytes == ARCH_LIMITS["sm_100"].shared_bytes == 227 * 1024


def test_resources_say_what_exceeds_the_limit() -> None:
    assert Resources(101376, 255, 0, 0, 256).misfit("sm_86") is None
    assert "shared memory" in Resources(101377, 128, 0, 0, 128).misfit("sm_86")
    assert Resources(101377, 128, 0, 0, 128).misfit("sm_90") is None
    assert "tensor-memory" in Resources(1000, 128, 0, 513, 128).misfit("sm_100")
    assert "registers" in Resources(1000, 255, 0, 0, 512).misfit("sm_90")
    assert "spills" in Resources(1000, 255, arch_check.SPILL_LIMIT_BYTES + 1, 0, 128).misfit("sm_90")
    assert "does not compile" in Resources(error="PTXASError: boom").misfit("sm_80")
    assert Resources.decode(Resources(1, 2, 3, 4, 5).encode()) == Resources(1, 2, 3, 4, 5)


def test_compile_check_names_the_arch_and_the_tuner_skips_it(planted) -> None:
    bad = KernelConfig(SMALL, window_block_m=64, window_block_n=64)
    reason = FORWARD.compile_check(problem(A100), bad)  # what the tuner asks before it runs a candidate
    assert reason is not None and reason.startswith("sm_80: window tiles 64/64/4/2") and "170000 bytes of shared memory" in reason
    assert FORWARD.compile_check(problem(gpu("sm_90")), bad) is None
    assert FORWARD.compile_check(problem(A100), KernelConfig(SMALL)) is None
    assert FORWARD.compile_check(problem(DeviceIdentity("cpu", "interpreter", 0)), bad) is None
    unrunnable = FORWARD.unrunnable(problem(A100))
    assert unrunnable and all(c["window_block_m"] == 64 and c["window_block_n"] == 64 or "sm_80" not in r for c, r in unrunnable)
    assert any(r.startswith("sm_80: window tiles 64/64/4/2") for _, r in unrunnable)
    lines = summary(FORWARD, problem(A100))
    assert lines[0].endswith("cannot run on sm_80 (compiled ahead of time):") and "shared memory" in "\n".join(lines)


def test_a_stale_table_warns_once_and_the_static_estimate_decides(planted) -> None:
    planted["variants"]["span_forward/tc_tiles"]["code_hash"] = "0" * 16
    use_table(planted)
    bad = KernelConfig(SMALL, window_block_m=64, window_block_n=64)
    with pytest.warns(RuntimeWarning, match="stale for span_forward/tc_tiles"):
        assert compiled_reason(FORWARD, problem(A100), bad) is None
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert FORWARD.compile_check(problem(A100), bad) is None
    assert not again  # once per variant
    assert "shared memory" in FORWARD.compile_check(problem(gpu("sm_86"), dtype="float32", head_dim=256),
                                                     KernelConfig(SMALL, span_block_n=128, span_stages=3))


def test_explain_shows_why_a_cached_configuration_cannot_run_on_the_arch(planted) -> None:
    bad = KernelConfig(SMALL, window_block_m=64, window_block_n=64)

    class Planted:
        name = "planted"

        def lookup(self, key, borrow=False):
            return LayerAnswer(TunedChoice("tc_tiles", bad), "")

    explanation = Dispatcher(REGISTRY, [Planted()]).explain(problem(A100))
    text = explanation.text()
    assert "skipped own key: sm_80: window tiles 64/64/4/2: window_attention_kernel needs 170000 bytes" in text
    assert explanation.choice.config != bad
    assert Dispatcher(REGISTRY, [Planted()]).explain(problem(gpu("sm_90"))).choice.config == bad
    assert key_of(problem(A100)).arch == "sm_80"


def test_explain_command_lists_what_cannot_run_on_a_named_arch(capsys) -> None:
    args = ["explain", "--op", "span_forward", "--queries", "8192", "--keys", "139264", "--arch", "sm_86"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "configurations that cannot run on sm_86:" in out
    assert "tc_tiles:" in out and "shared memory" in out
    assert "choice on sm_86: fits" in out


# --- the shipped table ------------------------------------------------------------------------


def test_shipped_table_covers_every_declared_configuration_for_the_current_code() -> None:
    table = shipped_table()
    assert table["key"] == "16bit/d128" and table["archs"] == list(ARCH_LIMITS)
    for variant, parts in covered().items():
        entry = table["variants"][variant]
        op, name = variant.split("/")
        assert entry["code_hash"] == REGISTRY.get(op, name).code_hash, f"{variant}: regenerate with `superlinear-ops archcheck`"
        for part, specs in parts.items():
            assert entry["parts"][part]["kernels"] == [s.name for s in specs]
            wanted = {config_key(v) for v in part_values(variant, part)}
            for arch in ARCH_LIMITS:
                results = entry["parts"][part]["results"][arch]
                assert set(results) == wanted, (variant, part, arch)
                assert all(len(v) == len(specs) for v in results.values())


@pytest.mark.parametrize("arch", list(ARCH_LIMITS))
def test_every_arch_can_run_the_defaults(arch: str) -> None:
    for op in ("span_forward", "span_backward"):
        variant = REGISTRY.get(op, "tc_tiles")
        p = problem(gpu(arch), op)
        assert not variant.not_supported_reasons(p)
        assert variant.compile_check(p, variant.default(p)) is None, (op, arch, variant.default(p))


def test_regenerating_one_variant_keeps_the_others_that_reuse_still_matches() -> None:
    shipped = shipped_table()
    asked, other = "span_backward/tc_tiles", "span_forward/tc_tiles"
    table = generate(variants=(asked,), reuse=shipped)  # both current: nothing to compile
    assert table["variants"] == shipped["variants"]
    stale = {**shipped, "variants": {**shipped["variants"], other: {**shipped["variants"][other], "code_hash": "0"}}}
    assert set(generate(variants=(asked,), reuse=stale)["variants"]) == {asked}


def test_shipped_table_rules_out_configurations_on_the_small_shared_memory_archs() -> None:
    use_table(None)
    for arch in ("sm_86", "sm_89", "sm_120"):
        reasons = [r for _, r in FORWARD.unrunnable(problem(gpu(arch)))]
        assert reasons and any("shared memory" in r for r in reasons)
    assert len(FORWARD.unrunnable(problem(gpu("sm_90")))) < len(FORWARD.unrunnable(problem(gpu("sm_86"))))


SAMPLE = [  # (variant, part, tiles): the smallest tiles, and large ones over the 99 KB archs' limit
    ("span_forward/tc_tiles", "span", (32, 16, 4, 2)),
    ("span_forward/tc_tiles", "window", (128, 64, 8, 3)),
    ("span_backward/tc_tiles", "span", (64, 64, 4, 3)),
]
COMPILE_SAMPLE = """
import json, sys
from superlinear_ops.arch_compile import compile_one, covered
out = []
for variant, part, arch, tiles in json.loads(sys.argv[1]):
    out.append([compile_one(spec, arch, tiles).encode() for spec in covered()[variant][part]])
print(json.dumps(out))
"""


def test_a_sample_compiled_now_matches_the_shipped_table(tmp_path) -> None:
    jobs = [(variant, part, arch, tiles) for variant, part, tiles in SAMPLE for arch in ("sm_80", "sm_120")]
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))  # fresh cache: ptxas reports
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", COMPILE_SAMPLE, json.dumps(jobs)], capture_output=True, text=True,
                         env=env, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    compiled = json.loads(run.stdout.strip().splitlines()[-1])
    table = shipped_table()
    for (variant, part, arch, tiles), resources in zip(jobs, compiled):
        assert table["variants"][variant]["parts"][part]["results"][arch][config_key(tiles)] == resources, (variant, part, arch, tiles)
    assert time.monotonic() - started < 120


def test_archcheck_command_help_and_report(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["archcheck", "--help"])
    assert "--out" in capsys.readouterr().out
    assert main(["archcheck", "--show"]) == 0
    out = capsys.readouterr().out
    assert "span_forward/tc_tiles on sm_86:" in out and "declared configurations cannot run" in out
    with pytest.raises(ValueError, match="archs"):
        from superlinear_ops.arch_compile import generate

        generate(archs=("sm_75",))


# --- the compiled signatures against what the launchers pass ------------------------------------------

_RUNTIME_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
                  torch.int64: "*i64", torch.uint8: "*u8", torch.int8: "*i8"}


def test_compiled_signatures_take_the_pointer_types_the_launchers_pass(monkeypatch) -> None:
    """Every covered kernel's ahead-of-time signature (``arch_compile.signature``) names, for each
    tensor argument, the element type the unmasked bf16 launch passes (positions int32, tile orders
    int64, ...); the descriptors' tensors as the pointer path (``KV_TMA``/``ROWS_TMA`` off) takes them."""
    from superlinear_ops.arch_compile import UNUSED_DESCRIPTORS, signature
    from superlinear_ops.launch import LaunchGeometry
    from superlinear_ops.ops.span_attention import tile_backward as span_tc_backward
    from superlinear_ops.ops.span_attention import tile_forward as span_tc_forward
    from superlinear_ops.ops.span_attention import window_backward as window_tc_backward
    from superlinear_ops.ops.span_attention import window_forward as window_attention
    from superlinear_ops.ops.span_attention.variants import TC_BACKWARD_DEFAULTS

    for module in (window_attention, span_tc_forward, window_tc_backward):  # the pointer path, as compiled
        monkeypatch.setattr(module, "row_descriptors", lambda *_: None)
    monkeypatch.setattr(window_tc_backward, "key_value_descriptors", lambda *_: None)
    specs = {spec.name: spec for parts in covered().values() for kernels in parts.values() for spec in kernels}
    spies = {name: LaunchSpy(spec.kernel(), tma_flag=None) for name, spec in specs.items()}
    for name, spec in specs.items():
        monkeypatch.setattr(f"{spec.module}.{name}", spies[name])

    gen = torch.Generator().manual_seed(0)
    lq, lkv, dim = 24, 40, 32
    q = torch.randn(1, 4, lq, dim, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, lkv, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    cache_position = torch.arange(lkv - lq, lkv)
    qstart = torch.randint(0, 8, (1, 4, lq, 3), generator=gen)
    qend = qstart + torch.randint(0, 8, (1, 4, lq, 3), generator=gen)
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, None, 6)
    tiles = {**SMALL, "window_head_split": 1, "span_sort_block": 16}
    out, lse = span_tc_forward.span_forward_tc(geo, tiles)
    span_tc_backward.span_backward_tc(geo, {**TC_BACKWARD_DEFAULTS, **tiles}, out, lse,
                                      torch.randn(out.shape, generator=gen).to(torch.bfloat16))

    for name, spec in specs.items():
        assert spies[name].arguments, f"{name}: not launched"
        types, _ = signature(spies[name].kernel, spec.constexprs(32, 16, 128), "bfloat16")
        for launch in spies[name].arguments:
            tensors = {arg: value.dtype for arg, value in launch.items() if isinstance(value, torch.Tensor)}
            assert {d for d in UNUSED_DESCRIPTORS if d in types} <= set(tensors), f"{name}: a descriptor was passed"
            if launch.get("UPCAST"):  # dO* is fp32 under the interpreter only
                tensors.update({arg: torch.bfloat16 for arg in ("dOs_ptr", "do_desc") if arg in tensors})
            for arg, dtype in tensors.items():
                if arg in ("mask_ptr", "suffix_ptr"):  # unmasked: never read, whatever the launcher passes
                    continue
                assert types[arg] == _RUNTIME_TYPES[dtype], f"{name}.{arg}: compiled as {types[arg]}, passed {dtype}"
