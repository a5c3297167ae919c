"""The public op at model M, an earlier commit's package against this tree's, side by side (GPU).

Each side runs in its own process (a package cannot be imported twice in one), the sides
interleaved over ``--rounds``; both read the tuned file the environment finds (under an editable
install, this tree's cache/ for both sides) with staleness ignored, so that both run the same
configurations (an edit re-hashes the kernels it touches, and their entries would otherwise fall
back to the defaults on one side only). Per case and process: host time per call (20 calls queued
without a sync) and the median of three do_bench medians; per side, their mean over the rounds;
and whether the first round's outputs (O, and training's gradients under one fixed output
gradient) equal the other side's, NaN where NaN. With ``--kernels REGEX``, also the device time per
call of each kernel whose name matches (PyTorch profiler, 5 calls), per side.

    PYTHONPATH=. python3 benchmarks/commit_vs_commit.py --base HEAD~1 --rounds 2
    PYTHONPATH=. python3 benchmarks/commit_vs_commit.py --cases "training 16384" --kernels 'window_d|span_tile_backward'
    PYTHONPATH=. python3 benchmarks/commit_vs_commit.py --base-dir /tmp/base --masks none ones left_padding

The earlier package comes from ``git archive BASE superlinear_ops cache`` (the repository's git
history is needed where it runs: ``--base-dir DIR`` takes an extracted tree instead).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

CASES = {  # name: (queries, keys, training)
    "prefill 8192 over 16384": (8192, 16384, False),
    "prefill 8192 over 139264": (8192, 139264, False),
    "prefill 32768 over 1048576": (32768, 1048576, False),
    "training 4096": (4096, 4096, True),
    "training 16384": (16384, 16384, True),
    "training 65536": (65536, 65536, True),
}
DEFAULT_CASES = ("prefill 8192 over 16384", "prefill 8192 over 139264", "training 4096")


def runs(cases: list[str], masks: list[str]) -> list[tuple[str, str, str | None]]:
    """(label, case, mask kind or None) of every case under every mask kind ('none': no mask)."""
    return [(name if kind == "none" else f"{name}, mask {kind}", name, None if kind == "none" else kind)
            for name in cases for kind in masks]


def measure(cases: list[str], masks: list[str], out_dir: pathlib.Path, label: str, kernels: str | None) -> None:
    """This process's side: time each case under each mask (and the kernels matching ``kernels``)
    and save its outputs and timings under ``out_dir``."""
    import torch
    from span_forward_tiles import bench, profile
    from whole_layer import public_call, warm_gpu  # this folder's model-M helpers

    import superlinear_ops
    import superlinear_ops.cache.validity as validity

    validity.why_stale = lambda entry: None  # the same tuned configurations on both sides
    print(f"{label}: package {pathlib.Path(superlinear_ops.__file__).parent}", flush=True)
    warm_gpu(1.0)
    timings = {}
    for name, case, mask_kind in runs(cases, masks):
        queries, keys, training = CASES[case]
        torch.manual_seed(0)
        call, _ = public_call(queries, keys, training, mask_kind)
        with torch.enable_grad() if training else torch.no_grad():
            torch.save([t.cpu() for t in call()], out_dir / f"{label} {name}.pt")
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                call()
            host = (time.perf_counter() - start) / 20
            torch.cuda.synchronize()
            wall = sorted(bench(call) for _ in range(3))[1]
            per_kernel = {row["name"]: row["ms_per_call"] for row in profile(call)
                          if re.search(kernels, row["name"])} if kernels else {}
        timings[name] = {"host_ms": 1e3 * host, "ms": wall, "kernels": per_kernel}
        print(f"{label}: {name}: {wall:.3f} ms, host {1e3 * host:.3f} ms per call", flush=True)
    (out_dir / f"{label}.json").write_text(json.dumps(timings))


def joined(runs: list[dict], key: str) -> str:
    return " / ".join(f"{run[key]:.3f}" for run in runs)


def compare(cases: list[str], masks: list[str], out_dir: pathlib.Path, rounds: int) -> None:
    """Medians and ratios of the sides' timings, and whether their outputs are equal."""
    import torch

    load = lambda label: json.loads((out_dir / f"{label}.json").read_text())  # noqa: E731
    sides = {side: [load(f"{side}{r}") for r in range(rounds)] for side in ("base", "tree")}
    for name, _, _ in runs(cases, masks):
        base, tree = ([run[name] for run in sides[side]] for side in ("base", "tree"))
        ms = [sum(r["ms"] for r in runs) / rounds for runs in (base, tree)]
        outputs = [torch.load(out_dir / f"{side}0 {name}.pt") for side in ("base", "tree")]
        if len(outputs[0]) != len(outputs[1]):
            same = f"of different counts ({len(outputs[0])} and {len(outputs[1])})"
        elif all(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(*outputs)):
            same = "identical"
        else:
            same = "max |diff| " + ", ".join(f"{(a.double() - b.double()).abs().max().item():.3g}" for a, b in zip(*outputs))
        print(f"{name}: base {joined(base, 'ms')} ms, this tree {joined(tree, 'ms')} ms, {ms[0] / ms[1]:.3f}x; "
              f"host per call base {joined(base, 'host_ms')}, this tree {joined(tree, 'host_ms')} ms; outputs {same}")
        for kernel in sorted({k for run in base + tree for k in run["kernels"]}):
            times = [" / ".join(f"{run['kernels'].get(kernel, float('nan')):.4f}" for run in runs) for runs in (base, tree)]
            print(f"    {kernel}: base {times[0]} ms, this tree {times[1]} ms")


def extract(base: str, into: pathlib.Path) -> pathlib.Path:
    """``git archive BASE`` of the package and its shipped caches, extracted under ``into``."""
    archive = subprocess.run(["git", "archive", base, "superlinear_ops", "cache"], capture_output=True, check=True).stdout
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD~1", help="the earlier commit (default: HEAD~1)")
    parser.add_argument("--base-dir", help="an extracted earlier tree (superlinear_ops/ and cache/) instead of --base")
    parser.add_argument("--rounds", type=int, default=2, help="processes per side, interleaved (default: 2)")
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=list(CASES), metavar="CASE",
                        help=f"cases to run, of: {'; '.join(CASES)} (default: the first two prefill cases, training 4096)")
    parser.add_argument("--masks", nargs="+", default=["none"], choices=["none", "ones", "holes", "left_padding"],
                        help="run each case under each of these attention masks (default: none; "
                             "holes: 10%% of the keys hidden, left_padding: the first 100)")
    parser.add_argument("--kernels", metavar="REGEX",
                        help="also profile the kernels whose names match, e.g. 'window_d|span_tile_backward'")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side in this process
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("commit_vs_commit.py needs a CUDA GPU; none is available")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.side:
        measure(args.cases, args.masks, pathlib.Path(args.out_dir), args.side, args.kernels)
        return 0
    with tempfile.TemporaryDirectory(prefix="commit_vs_commit_") as tmp:
        out_dir = pathlib.Path(tmp)
        base_dir = pathlib.Path(args.base_dir) if args.base_dir else extract(args.base, out_dir / "base")
        if not (base_dir / "superlinear_ops").is_dir():
            parser.error(f"{base_dir} has no superlinear_ops/ folder")
        here = pathlib.Path(__file__).resolve().parent
        tree = here.parent
        for r in range(args.rounds):
            for side, package_root in (("base", base_dir), ("tree", tree)):
                path = os.pathsep.join([str(package_root), str(here), os.environ.get("PYTHONPATH", "")])
                profiled = ["--kernels", args.kernels] if args.kernels else []
                subprocess.run([sys.executable, __file__, "--side", f"{side}{r}", "--out-dir", tmp, *profiled,
                                "--cases", *args.cases, "--masks", *args.masks], env={**os.environ, "PYTHONPATH": path},
                               check=True)
        compare(args.cases, args.masks, out_dir, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
