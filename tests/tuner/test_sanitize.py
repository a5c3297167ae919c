"""The memory-check sweep (``superlinear-ops sanitize``): its covering set of each declared space,
its layouts, and a dry run on this CPU machine (no compute-sanitizer: correctness only)."""

from __future__ import annotations

import pathlib
import sys

import torch

from superlinear_ops.buckets import key_of
from superlinear_ops.launch import KernelConfig
from superlinear_ops.problem import DeviceIdentity, device_identity
from superlinear_ops.registry import REGISTRY
from superlinear_ops.tuner import sanitize as sweep
from superlinear_ops.tuner.sanitize import covering_configs, items, layouts, sanitize

ROOT = pathlib.Path(__file__).resolve().parents[2]
H200 = DeviceIdentity("NVIDIA H200", "sm_90", 132)
LAYER = "^layer[^:]*$"  # the quick workload's layer problem alone (not its gate parts)


def test_covering_set_has_every_value_and_every_pipeline_depth_with_every_tile_width() -> None:
    variant = REGISTRY.get("span_backward", "tc_tiles")
    case = layouts(str(ROOT / "tuning" / "superlinear-exp-v0.1.yaml"), H200, "training 4096 backward")[0]
    default = variant.default(case.problem)
    configs = covering_configs(variant, default)
    assert default in configs and len(configs) == len(set(configs))
    for param in variant.space:
        assert {c[param.name] for c in configs} == set(param.values), param.name
    for part in ("window", "span"):
        space = {p.name: p.values for p in variant.space}
        pairs = {(c[f"{part}_stages"], c[f"{part}_block_n"]) for c in configs}
        assert pairs == {(s, n) for s in space[f"{part}_stages"] for n in space[f"{part}_block_n"]}, part
    # Configurations the static check rules out on this GPU are left out of the sweep, the rest kept.
    swept = [c for v, c in items(case) if v is variant]
    assert 0 < len(swept) <= len(configs)
    assert all(variant.compile_check(case.problem, c) is None for c in swept)


def test_a_variant_filter_sweeps_only_the_variants_it_names() -> None:
    """``--variants``: the covering sets of the matching variants alone, each whole."""
    case = layouts(str(ROOT / "tuning" / "superlinear-exp-v0.1.yaml"), H200, "^decode 4096$")[0]
    every, chosen = items(case), items(case, "^grouped$")
    assert {v.name for v, _ in chosen} == {"grouped"}
    assert chosen == [(v, c) for v, c in every if v.name == "grouped"]
    assert len({v.name for v, _ in every}) > 1


def test_layouts_keep_spans_and_share_one_shape_per_layout() -> None:
    """Small shapes past twice the window (queries have spans), one per problem key: the decode
    contexts of one layout collapse, training stays one query per key."""
    found = layouts(str(ROOT / "tuning" / "superlinear-exp-v0.1.yaml"), H200, None)
    assert len({c.label for c in found}) == len(found)
    for case in found:
        p = case.problem
        assert p.keys > 2 * p.window, case.label
        if case.label.startswith("training"):
            assert p.queries == p.keys, case.label
    assert sum(c.label.startswith("decode 1048576") for c in found) == 0  # the same layout as a shorter context


def test_a_child_finds_a_selected_layout_that_another_problem_stands_for_in_the_whole_workload() -> None:
    """The masked 4K decode shares its small layout with the static-cache decode listed before it: selected
    alone, it is its layout's problem, and the child process runs it by its own label."""
    path = str(ROOT / "tuning" / "superlinear-exp-v0.1.yaml")
    cpu = device_identity(torch.device("cpu"))
    label = "decode 4096, mask ones/holes/left_padding"
    assert label not in {c.label for c in layouts(path, cpu, None)}, "no longer a layout another problem stands for"
    selected = layouts(path, cpu, "^decode 4096, mask")
    assert [c.label for c in selected] == [label]
    try:
        status = sweep.run_child(path, label, key_of(selected[0].problem).text(), 0, 0, torch.device("cpu"))
    except StopIteration:
        status = None
    assert status == 0, "the child did not find its layout by the label the parent gave it"


def test_a_child_tells_apart_two_problems_that_share_a_label(tmp_path, monkeypatch) -> None:
    """Two op entries that differ only in batch share a label: the child runs the one the parent meant."""
    path = tmp_path / "two-batches.yaml"
    path.write_text((ROOT / "tuning" / "quick.yaml").read_text().replace(
        "problems:\n", "problems:\n  - op: {name: staged_decode, queries: 1, keys: 64, batch: 1}\n"
        "  - op: {name: staged_decode, queries: 1, keys: 64, batch: 3}\n"))
    cpu = device_identity(torch.device("cpu"))
    pair = [c for c in layouts(str(path), cpu, "^staged_decode")]
    assert len(pair) == 2 and pair[0].label == pair[1].label, [c.label for c in pair]
    ran = []
    monkeypatch.setattr(sweep, "ProblemBench", lambda case, device, seed: ran.append(case.problem.batch))
    assert sweep.run_child(str(path), pair[1].label, key_of(pair[1].problem).text(), 0, 0, torch.device("cpu")) == 0
    assert ran == [3], f"the child ran batch {ran}, not the parent's 3"


def test_dry_run_on_cpu_reports_every_configuration_of_the_swept_layouts(capsys) -> None:
    from superlinear_ops.cli import main

    rows = sanitize(str(ROOT / "tuning" / "quick.yaml"), "cpu", only=LAYER, progress_bar=False)
    case = layouts(str(ROOT / "tuning" / "quick.yaml"), device_identity(torch.device("cpu")), LAYER)[0]
    assert [(r.variant, r.config) for r in rows] == [(v.qualified_name, c.text()) for v, c in items(case)]
    first = rows[0].variant.split("/")[1]  # the command's summary, over one variant's configurations
    assert main(["sanitize", str(ROOT / "tuning" / "quick.yaml"), "--problems", LAYER, "--variants", f"^{first}$",
                 "--device", "cpu", "--jobs", "2"]) == 0
    summary = f"{sum(r.variant.endswith('/' + first) for r in rows)} configurations over 1 layouts, 0 with errors (dry run, no sanitizer, "
    assert summary in capsys.readouterr().out
    assert len(rows) > 1 and all(r.clean for r in rows), [r for r in rows if not r.clean]


# A stand-in child: item 1 ends the process the way an illegal access does, item 3 prints sanitizer
# errors, the rest pass; it runs the items it is told to.
FAKE_CHILD = f"""
import os, sys
for i in range(int(sys.argv[1]), int(sys.argv[2])):
    print("{sweep.ITEM}", i, "v", "c", flush=True)
    if i == 1:
        os._exit(139)
    if i == 3:
        print("========= Invalid __global__ read of size 16 bytes", flush=True)
        print("=========     at kernel+0x10", flush=True)
    print("{sweep.DONE}", i, "ok", flush=True)
print("========= ERROR SUMMARY: 1 error")
"""


def test_a_child_that_dies_is_restarted_after_the_configuration_that_ended_it(monkeypatch) -> None:
    """Chunks of one layout run in parallel children; the one that dies is restarted after its
    configuration, and every configuration of every chunk gets its verdict."""
    monkeypatch.setattr(sweep, "items", lambda case, variants=None: [(REGISTRY.variants(case.problem.op)[0], KernelConfig())] * 13)
    monkeypatch.setattr(sweep.shutil, "which", lambda name: "compute-sanitizer")
    monkeypatch.setattr(sweep, "device_identity", lambda device: device_identity(torch.device("cpu")))
    monkeypatch.setattr(sweep, "_child_command", lambda *a: [sys.executable, "-c", FAKE_CHILD, str(a[4]), str(a[5])])
    rows = sanitize(str(ROOT / "tuning" / "quick.yaml"), "cuda", only=LAYER, progress_bar=False, jobs=3)
    assert len(rows) == 13 and sweep.CHUNK < 13
    assert [i for i, r in enumerate(rows) if not r.clean] == [1, 3]
    assert rows[1].verdict.startswith("the child ended here (exit 139)")
    assert rows[3].errors == ["Invalid __global__ read of size 16 bytes", "at kernel+0x10"] and rows[3].verdict == "ok"
