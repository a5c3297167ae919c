"""The targets table at model M on one GPU, in one run: every target case, ours beside dense attention.

Cases (``--cases REGEX`` keeps those whose name matches; default all):
- prefill: an 8192-query chunk at the end of 16,384 and 139,264 keys, a 32,768-query chunk at the end of
  1,048,576 and 10,000,000 keys. Ours: the public ``superlinear_attention`` forward, and the search alone
  (``torch_ops.layer_search``). Dense: the chunk over the prefix without a mask plus the chunk over itself,
  causal (``whole_layer.dense_times``: K/V repeated to 32 heads outside the timing); not run at 10M keys.
  Ours' output is checked against the float64 layer on query rows spread over the chunk (the library's
  PyTorch reference, which reads K and V a block at a time, so it fits in memory at 10M keys).
- training: forward + backward at Lq = Lkv = 4096, 16384, 65536; dense causal forward + backward.
- decode: one step, B = 1 over 4K, 64K, 256K, 1M and 10M keys without a mask; B = 4 and B = 16 over 4K,
  64K, 256K and 1M keys without a mask and with 10% holes. Ours: the public decode step (the dispatcher's
  choice, checked against the float64 reference first) replayed from a CUDA graph. Dense: SDPA on the same
  inputs with grouped heads, or with K/V repeated to every query head where a backend needs that (out of
  memory for the copy: the reason recorded).

Per case: ours' median ms; SDPA's with the cuDNN and with the flash backend forced (or why it did not run);
ours over cuDNN (below 1: ours is faster); the lower bound and its basis; the effective throughput (the
bound's FLOPs over ours' time for prefill and training, TFLOP/s; its bytes over ours' time for decode,
GB/s); ours' kernels one by one (PyTorch profiler); training also replayed from a CUDA graph; for decode
the dispatcher's choice and its source. Then the registers, spills and shared memory of every compiled variant of the package's Triton kernels.
Every case of ours is timed before any dense backend runs (slow dense runs leave the GPU slower for a
while). The JSON (``--out``) is rewritten after every step, so a run cut short keeps what it measured,
and ``--resume`` goes on with it on the same machine and tree, skipping what it holds (a run split over
several calls, e.g. by ``--cases``; the tables then cover every case it holds);
at the end it also holds ``report_tables``, the run as tables for ``docs/benchmarks/<gpu>.json``;
the Markdown table goes to stdout and next to the JSON (same name, ``.md``). With ``--memcheck REGEX``, the
variants whose name matches run last under compute-sanitizer's memcheck at small shapes, every layout of the
workload and a covering set of each declared space (``superlinear-ops sanitize``); the count of
configurations and those with errors go into the JSON and the Markdown.

Model M: Hq 32, Hkv 2, D 128, bf16, sw_index 65, search power 0.55 (float path), span power 0.55, bf 3,
ff 1, topk 3; B 1 unless stated.

Run on a GPU:  PYTHONPATH=. python benchmarks/targets.py --out targets.json [--memcheck '^(one_launch|split_merge)$']
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import whole_layer
from decode_masks import sdpa_times  # this folder's decode helpers
from decode_variants import api_call, kernel_times
from span_forward_tiles import bench, kernel_registers, profile
from whole_layer import ARGS, BF, FF, HQ, POWER, SETTINGS, SPAN_POWER, SW_INDEX, TOPK, D, captured, dense_times, inputs, warm_gpu
from whole_layer import lower_bound as layer_bound

from superlinear_ops import dispatch, torch_ops
from superlinear_ops.launch import KernelConfig
from superlinear_ops.layer_api import superlinear_attention
from superlinear_ops.ops.layer_search.reference import search_reference
from superlinear_ops.ops.span_attention.spec import TRAINING_FLOPS
from superlinear_ops.ops.spec import dense_flops
from superlinear_ops.problem import STAGED_DECODE, device_identity
from superlinear_ops.tuner.bench import DENSE_FLOP_LIMIT, bound_of_traffic, device_peaks, traffic
from superlinear_ops.tuner.runner import ProblemBench, make_inputs, measure
from superlinear_ops.tuner.sanitize import sanitize
from superlinear_ops.tuner.workload import Case, load

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "tuning" / "superlinear-exp-v0.1.yaml"
PREFILL = ((8192, 16384), (8192, 139264), (32768, 1048576), (32768, 10_000_000))
TRAINING = (4096, 16384, 65536)
DECODE_CONTEXTS = (4096, 65536, 262144, 1048576)
DECODE_SINGLE = (*DECODE_CONTEXTS, 10_000_000)  # B = 1, no mask
DECODE_BATCHES = (4, 16)  # without a mask and with 10% holes
DECODE_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION")
KERNELS_KEPT = 12  # profiler rows kept per prefill / training case
CHECKED_ROWS = {1_048_576: 32, 10_000_000: 8}  # prefill query rows checked against float64 (default 16)


@dataclasses.dataclass(frozen=True)
class Target:
    """One case of the table: its name, kind ('prefill', 'training' or 'decode') and shape."""

    name: str
    kind: str
    queries: int
    keys: int
    batch: int = 1
    holes: bool = False  # decode with a mask of 10% holes


def all_targets() -> list[Target]:
    """Every case of the table, in the order it runs."""
    rows = [Target(f"prefill {lq} over {lkv}", "prefill", lq, lkv) for lq, lkv in PREFILL]
    rows += [Target(f"training {n}", "training", n, n) for n in TRAINING]
    rows += [Target(f"decode {n}", "decode", 1, n) for n in DECODE_SINGLE]
    rows += [Target(f"decode {n}, B={b}" + (", 10% holes" if holes else ""), "decode", 1, n, b, holes)
             for b in DECODE_BATCHES for n in DECODE_CONTEXTS for holes in (False, True)]
    return rows


def decode_case(target: Target, cases: dict[str, Case]) -> Case:
    """The workload's decode case of ``target`` (a masked one restricted to the 'holes' mask)."""
    label = f"decode {target.keys}" + (f", B={target.batch}" if target.batch > 1 else "")
    if not target.holes:
        return cases[label]
    return dataclasses.replace(cases[f"{label}, mask ones/holes/left_padding"], mask_kinds=("holes",))


def dense_columns(short: str, ms: float | None, reason: str | None) -> dict:
    """``sdpa_<short>_ms`` (None when the backend did not run) and then ``sdpa_<short>_reason``."""
    return {f"sdpa_{short}_ms": ms} if ms is not None else {f"sdpa_{short}_ms": None, f"sdpa_{short}_reason": reason}


def layer_ours(target: Target) -> dict:
    """Ours on a prefill or training case: the public op, the search alone, the bound, the kernels."""
    training = target.kind == "training"
    q1, q2, k, v, cp, _ = inputs(target.queries, target.keys, seed=4, grad=training)
    grad = torch.randn(1, HQ, target.queries, D, device=k.device, dtype=torch.bfloat16)

    def ours() -> None:
        out = superlinear_attention(q1, q2, k, v, cp, None, **ARGS)
        if training:
            torch.autograd.grad(out, (q1, q2, k, v), grad)

    def search() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return torch_ops.layer_search(q1, k, cp, None, SW_INDEX, TOPK, BF, FF, SPAN_POWER, POWER, None)

    row = {"ours_ms": bench(ours), "search_ms": bench(search)}
    if training:  # the step without the host: where eager calls are host-bound, this is the GPU's time
        row["ours_graph_ms"] = bench(captured(ours)[0].replay)
    anchors = search()[0]
    bound = layer_bound(target.queries, target.keys, training, anchors, cp)
    tflop = bound["attention_tflop"] + bound["search_tflop"]
    row["bound"] = {**bound, "tflop": tflop}
    row["throughput"] = {"value": tflop / (row["ours_ms"] * 1e-3), "unit": "TFLOP/s",
                         "basis": "the bound's FLOPs (4 D per attended (query head, key) pair, x 3.5 for training, plus the "
                                  "search's 2 D per (query head, stripe): whole_layer.lower_bound) / ours' time"}
    row["kernels"] = profile(ours)[:KERNELS_KEPT]  # ms_per_call each; count over 5 calls
    if not training:  # a failed check records its error beside the timings
        step(row, "float64", lambda: {"float64_rows": prefill_errors(target, q1, q2, k, v, cp, anchors)})
    return row


def prefill_errors(target: Target, q1, q2, k, v, cp, anchors: torch.Tensor) -> dict:
    """Ours' output on query rows spread over the chunk (the first and the last among them) against the
    float64 layer on those rows (the library's PyTorch reference, K and V read a block at a time, so it fits
    at 10M keys): on the float64 search's anchors, and on ours' (the attention apart from near-ties that two
    correct searches may break differently)."""
    count = CHECKED_ROWS.get(target.keys, 16)
    pick = torch.tensor(sorted({round(i * (target.queries - 1) / (count - 1)) for i in range(count)}), device=k.device)
    r1, r2, at, ours_anchors = q1[:, :, pick].double(), q2[:, :, pick].double(), cp[pick], anchors[:, :, pick]
    with torch.no_grad():
        out = superlinear_attention(q1, q2, k, v, cp, None, **ARGS)[:, :, pick].double()
        exact = search_reference(r1, k, at, None, SETTINGS.for_keys(target.keys), KernelConfig()).anchors
        want, given = (whole_layer.reference_layer(r1, r2, k, v, at, None, a) for a in (exact, ours_anchors))

    def relative(ref: torch.Tensor) -> float:
        return ((out - ref).abs().max() / ref.abs().max()).item()

    return {"rows": pick.tolist(), "error": relative(want), "error_on_our_anchors": relative(given),
            "head_rows_with_other_anchors": whole_layer.rows_with_other_anchor_sets(ours_anchors, exact), "nan": bool(out.isnan().any())}


def layer_dense(target: Target) -> dict:
    """Dense SDPA on a prefill or training case, cuDNN and flash forced (or why it is not run)."""
    training = target.kind == "training"
    q = torch.empty(1, HQ, target.queries, D, device="meta")  # the chunk over the prefix, then over itself, causal
    flop = (dense_flops(q, target.keys - target.queries, causal=False) + dense_flops(q, target.queries, causal=True)) \
        * (TRAINING_FLOPS if training else 1.0)
    if flop > DENSE_FLOP_LIMIT:  # the library's rule for bench and verify
        rate = whole_layer.peaks()[1]
        reason = f"not run: {flop / 1e15:.1f} PFLOP per call (at least {flop / rate:.0f} s at {rate / 1e12:.0f} TFLOP/s)"
        return {**dense_columns("cudnn", None, reason), **dense_columns("flash", None, reason)}
    _, q2, k, v, _, _ = inputs(target.queries, target.keys, seed=4)
    grad = torch.randn(1, HQ, target.queries, D, device=k.device, dtype=torch.bfloat16)
    times = dense_times(q2, k, v, training, grad)
    return {**dense_columns("cudnn", times.get("sdpa_cudnn_ms"), times.get("sdpa_cudnn_error")),
            **dense_columns("flash", times.get("sdpa_flash_ms"), times.get("sdpa_flash_error"))}


def decode_ours(case: Case, device: torch.device) -> dict:
    """Ours on a decode case: the public step from a CUDA graph, its kernels, choice and bound."""
    problem_bench = ProblemBench(case, device, seed=0)
    explanation = dispatch.explain(case.problem)
    choice = explanation.choice
    if choice is None:
        raise RuntimeError(explanation.text())
    call = api_call(problem_bench)
    row = {"error_vs_float64_reference": problem_bench.check(choice.variant, choice.config),
           "ours_ms": measure(call, device, graph=True), "kernels_ms": kernel_times(call, device),
           "choice": f"{choice.variant.name} {choice.config.text()}", "source": choice.source, "rule": explanation.rule}
    bytes_, flop = traffic(case, [problem_bench.inputs])  # on the inputs ours is timed on
    ms, basis = bound_of_traffic(case, bytes_, flop)
    row["bound"] = {"ms": ms if math.isfinite(ms) else None, "basis": basis, "gb": bytes_ / 1e9, "tflop": flop / 1e12}
    row["throughput"] = {"value": bytes_ / 1e9 / (row["ours_ms"] * 1e-3), "unit": "GB/s",
                         "basis": "the bound's bytes (what an ideal step moves on these inputs, tuner.bench.traffic) / ours' time"}
    return row


def decode_dense(case: Case, device: torch.device) -> dict:
    """Dense SDPA on the decode case's inputs (the same as ours'), per backend forced, from a CUDA graph."""
    x = make_inputs(case, device, seed=0)  # what ProblemBench(case, device, seed=0) times ours on
    times = sdpa_times(x, device, backends=DECODE_BACKENDS)
    row = {"sdpa_by_backend": times}
    for short, backend in (("cudnn", "CUDNN_ATTENTION"), ("flash", "FLASH_ATTENTION")):
        tried = {name: ms for name, ms in times.items() if name.startswith(backend)}
        ran = [ms for ms in tried.values() if isinstance(ms, float)]
        row.update(dense_columns(short, ran[0] if ran else None, "; ".join(f"{n}: {r}" for n, r in tried.items())))
    return row


def step(row: dict, what: str, fn: Callable[[], dict]) -> None:
    """Merge ``fn()`` into ``row``; on failure record ``<what>_error`` and go on; free GPU memory after."""
    try:
        row.update(fn())
    except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
        row[f"{what}_error"] = f"{type(exc).__name__}: {exc}"[:600]
        traceback.print_exc()
    gc.collect()
    torch.cuda.empty_cache()


def compiled_kernels() -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of the package's Triton kernels."""
    kernels = {id(k): k for name, module in sys.modules.items() if name.startswith("superlinear_ops") and module
               for k in vars(module).values() if isinstance(k, triton.runtime.JITFunction)}
    return kernel_registers(kernels.values())


def memcheck(variants: str, device: str = "cuda") -> dict:
    """The sanitize sweep of the variants whose name matches ``variants`` over the workload's layouts."""
    began = time.time()
    rows = sanitize(str(WORKLOAD), device, "memcheck", progress_bar=False, jobs=os.cpu_count() or 1, variants=variants)
    return {"variants": variants, "configurations": len(rows), "layouts": len({r.layout for r in rows}),
            "seconds": round(time.time() - began),
            "with_errors": [f"{r.layout} | {r.variant} {r.config}: {r.verdict}; {(r.errors or ['-'])[0]}" for r in rows if not r.clean]}


def git_state() -> dict:
    """The checkout's short commit and whether tracked files differ from it (None without git)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    try:
        return {"commit": git("rev-parse", "--short", "HEAD"), "tree_modified": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "tree_modified": None}


def measured(row: dict | None, phase: str) -> bool:
    """Whether ``row`` already holds its ``phase`` ('ours' or 'dense'): a time or that phase's error."""
    if row is None:
        return False
    return f"{phase}_error" in row or ("ours_ms" in row if phase == "ours" else "sdpa_cudnn_ms" in row)


def resumed(out: Path, fresh: dict, parser: argparse.ArgumentParser) -> dict:
    """The run in ``out`` to go on with, refused (through ``parser``) unless it was measured on this machine
    (GPU and host) from this tree (commit and whether tracked files differed): timings of one run only."""
    try:
        report = json.loads(out.read_text())
    except (OSError, ValueError) as err:
        parser.error(f"--resume: cannot read {out} ({err}); run without --resume to start it")
    same = ("device", "host", "commit", "tree_modified")
    differ = [f"{key} {report.get(key)!r} there, {fresh[key]!r} here" for key in same if report.get(key) != fresh[key]]
    if differ:
        parser.error(f"--resume: {out} is another run ({'; '.join(differ)}); start a new file")
    report.setdefault("resumed", []).append({"date": fresh["date"], "command": fresh["command"]})
    return report


def fmt(value: float | None, digits: int = 4) -> str:
    """A number for the Markdown table ('-' for none)."""
    return "-" if value is None else f"{value:.{digits}g}"


def markdown(report: dict) -> str:
    """The targets table, the notes on what did not run, and the compiled kernels, as Markdown."""
    lines = [f"# Targets on {report['device']}", "",
             f"torch {report['torch']}, triton {report['triton']}, commit {report['commit']}"
             f"{' (modified)' if report['tree_modified'] else ''}, {report['date']}", "",
             "| case | ours ms | SDPA cuDNN ms | SDPA flash ms | ours / cuDNN | bound ms | throughput | error vs float64 | ours' choice |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    notes = []
    for name, row in report["rows"].items():
        notes += [f"- {name}: {key}: {row[key]}" for key in row if key.endswith(("_error", "_reason"))]
        throughput = row.get("throughput")
        choice = f"{row['choice']} ({row['source']})" if "choice" in row else "-"
        error = row.get("error_vs_float64_reference", row.get("float64_rows", {}).get("error"))
        lines.append(f"| {name} | {fmt(row.get('ours_ms'))} | {fmt(row.get('sdpa_cudnn_ms'))} | {fmt(row.get('sdpa_flash_ms'))} "
                     f"| {fmt(row.get('ours_over_cudnn'), 3)} | {fmt(row.get('bound', {}).get('ms'))} "
                     f"| {fmt(throughput['value']) + ' ' + throughput['unit'] if throughput else '-'} | {fmt(error, 2)} | {choice} |")
    lines += ["", "Ours / cuDNN below 1: ours is faster. Throughput: prefill and training the bound's FLOPs, decode its bytes, "
              "over ours' time.", ""] + (["Not run or failed:", "", *notes, ""] if notes else [])
    if "memcheck" in report:
        check = report["memcheck"]
        lines += [f"Memcheck of the variants matching `{check['variants']}`: {check['configurations']} configurations over "
                  f"{check['layouts']} layouts, {len(check['with_errors'])} with errors.", "", *[f"- {e}" for e in check["with_errors"]], ""]
    lines += ["| kernel | warps | stages | registers | spills | shared bytes |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {k['kernel']} | {k['warps']} | {k['stages']} | {k['registers']} | {k['spills']} | {k['shared_bytes']} |"
              for k in report.get("compiled_kernels", [])]
    return "\n".join(lines) + "\n"


def kernel_ms(row: dict, name: str) -> float | None:
    """The profiled per-call milliseconds of the kernel whose name starts with ``name`` (None if absent)."""
    return next((k["ms_per_call"] for k in row.get("kernels", []) if k["name"].startswith(name)), None)


def report_tables(report: dict, commit: str) -> list[dict]:
    """The run as tables of a GPU's benchmark report (``superlinear_ops.tuner.report``'s schema): the
    whole layer's prefill and training in ms, decode in us (those the run has rows for); ``commit`` is
    the commit the run measured."""
    date, command = report["date"][:10], "PYTHONPATH=. python benchmarks/targets.py --out targets.json"
    rows = report["rows"].items()
    layer = {kind: [{"case": name, "ours": row.get("ours_ms"), "bound": row.get("bound", {}).get("ms"),
                     "dense": row.get("sdpa_cudnn_ms"), "flash": row.get("sdpa_flash_ms"), "search": row.get("search_ms"),
                     "span_tiles": kernel_ms(row, "span_tile_kernel"), "graph": row.get("ours_graph_ms"),
                     "tflops": f"{row['throughput']['value']:.0f}",
                     **({"error": f"{row['float64_rows']['error']:.1e}"} if "float64_rows" in row else {})}
                    for name, row in rows if row["kind"] == kind and "ours_ms" in row] for kind in ("prefill", "training")}

    def us(ms: float | None) -> float | None:
        return None if ms is None else 1e3 * ms

    decode = [{"case": name, "ours": us(row["ours_ms"]), "bound": us(row["bound"]["ms"]),
               "dense": us(row.get("sdpa_cudnn_ms")), "flash": us(row.get("sdpa_flash_ms")), "variant": row["choice"].split()[0],
               "gbs": f"{row['throughput']['value']:.0f}", "error": f"{row['error_vs_float64_reference']:.1e}"}
              for name, row in rows if row["kind"] == "decode" and "ours_ms" in row]
    shared = {"date": date, "commit": commit, "command": command, "dense_backend": "cuDNN"}
    bandwidth, rate = device_peaks(report["device"])
    layer_table = {**shared, "units": "ms",
                   "bound": f"max(bytes / {bandwidth / 1e12:.1f} TB/s, FLOPs / {rate / 1e12:.0f} TFLOP/s) (whole_layer.lower_bound)"}
    columns = {"flash": "dense (flash)", "search": "search alone", "span_tiles": "span tiles kernel"}
    throughput_note = "TFLOP/s: the bound's FLOPs (attended pairs and stripe scores) over ours' time."
    tables = [
        {**layer_table, "title": "Targets: whole layer, prefill (`superlinear_attention`)",
         "columns": {**columns, "tflops": "TFLOP/s", "error": "error vs float64"}, "rows": layer["prefill"],
         "notes": ["Eager calls (do_bench medians, L2 flushed). Dense: the chunk over the prefix plus the chunk over "
                   "itself, causal; not run at 10M keys (about 5 PFLOP a call).", throughput_note,
                   "Error: max |ours - float64| / max |float64| over query rows spread across the chunk (32 at 1M keys, "
                   "8 at 10M, 16 otherwise; all heads), the float64 layer being the library's PyTorch reference on "
                   "those rows."]},
        {**layer_table, "title": "Targets: whole layer, training (forward + backward)",
         "columns": {**columns, "graph": "ours, CUDA graph", "tflops": "TFLOP/s"}, "rows": layer["training"],
         "notes": ["Eager steps (do_bench medians, L2 flushed), and the same step replayed from a CUDA graph: the "
                   "GPU's time where an eager step waits for the host. Dense: causal.", throughput_note]},
        {**shared, "title": "Targets: decode step at B 1, 4 and 16", "units": "us",
         "bound": "the bytes an ideal step moves on the same inputs (each key a KV group attends read once) over the "
                  "GPU's copy bandwidth (tuner.bench.lower_bound)",
         "columns": {"flash": "dense (flash)", "variant": "variant", "gbs": "GB/s", "error": "error vs float64"},
         "notes": ["Replayed CUDA graph of the public decode step with the shipped entries (do_bench median, L2 "
                   "flushed); dense SDPA from a CUDA graph on the same inputs. The flash backend takes no mask.",
                   "GB/s: the bound's bytes over ours' time."],
         "rows": decode},
    ]
    return [table for table in tables if table["rows"]]


def progress(name: str, phase: str, row: dict) -> None:
    """One timestamped line on a case's finished phase ('ours' or 'dense')."""
    if f"{phase}_error" in row:
        text = row[f"{phase}_error"][:200]
    elif phase == "ours":
        text = (f"ours {fmt(row['ours_ms'])} ms, bound {fmt(row['bound']['ms'])} ms, "
                f"{fmt(row['throughput']['value'])} {row['throughput']['unit']}")
    else:
        text = f"cuDNN {fmt(row['sdpa_cudnn_ms'])} ms, flash {fmt(row['sdpa_flash_ms'])} ms, ours / cuDNN {fmt(row.get('ours_over_cudnn'), 3)}"
    print(f"[{time.strftime('%H:%M:%S')}] {name} ({phase}): {text}", flush=True)


def save(report: dict, out: Path) -> None:
    """Write ``report`` to ``out`` through a temporary file (a run killed mid-write keeps the last one)."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write (the Markdown table goes next to it, .md)")
    parser.add_argument("--commit", help="the commit measured, for the report tables (default: git's HEAD here)")
    parser.add_argument("--cases", default="", help="only the cases whose name matches this regular expression, e.g. '^decode .*B=16'")
    parser.add_argument("--memcheck", metavar="REGEX", help="at the end, memcheck the variants whose name matches at small shapes")
    parser.add_argument("--resume", action="store_true",
                        help="go on with --out's run on the same machine and tree: skip what it measured, add the rest "
                        "(one run split over several calls, e.g. --cases '^(prefill|training)' then --cases '^decode')")
    args = parser.parse_args()
    try:
        targets = [t for t in all_targets() if re.search(args.cases, t.name)]
    except re.error as err:
        parser.error(f"--cases: {err}")
    try:
        re.compile(args.memcheck or "")
    except re.error as err:
        parser.error(f"--memcheck: {err}")
    if not targets:
        parser.error(f"--cases {args.cases!r} matches none of: {'; '.join(t.name for t in all_targets())}")
    if not torch.cuda.is_available():
        raise SystemExit("targets.py needs a CUDA GPU; none is available")
    device = torch.device("cuda")
    cases = {c.label: c for c in load(WORKLOAD).cases(device_identity(device)) if c.problem.op == STAGED_DECODE}
    report = {"device": torch.cuda.get_device_name(), "host": socket.gethostname(), "torch": torch.__version__,
              "triton": triton.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              **git_state(), "command": " ".join(sys.argv), "rows": {}}
    if args.resume:
        report = resumed(args.out, report, parser)
    rows = report["rows"]
    warm_gpu()
    for t in targets:  # every case of ours before any dense backend
        if measured(rows.get(t.name), "ours"):
            continue
        rows[t.name] = {"kind": t.kind, "batch": t.batch, "queries": t.queries, "keys": t.keys, "mask": "10% holes" if t.holes else None}
        ours = (lambda t=t: layer_ours(t)) if t.kind != "decode" else (lambda t=t: decode_ours(decode_case(t, cases), device))
        step(rows[t.name], "ours", ours)
        progress(t.name, "ours", rows[t.name])
        save(report, args.out)
    for t in targets:
        row = rows[t.name]
        if measured(row, "dense"):
            continue
        dense = (lambda t=t: layer_dense(t)) if t.kind != "decode" else (lambda t=t: decode_dense(decode_case(t, cases), device))
        step(row, "dense", dense)
        if isinstance(row.get("ours_ms"), float) and isinstance(row.get("sdpa_cudnn_ms"), float):
            row["ours_over_cudnn"] = row["ours_ms"] / row["sdpa_cudnn_ms"]
        progress(t.name, "dense", row)
        save(report, args.out)
    earlier = report.get("compiled_kernels", [])  # a resumed run's: those compiled by its earlier calls
    now = json.loads(json.dumps(compiled_kernels(), default=str))  # as the JSON holds them
    report["compiled_kernels"] = earlier + [k for k in now if k not in earlier]
    if args.memcheck:
        step(report, "memcheck", lambda: {"memcheck": memcheck(args.memcheck)})
    report["rows"] = {t.name: rows[t.name] for t in all_targets() if t.name in rows}  # the table's order, however resumed
    report["report_tables"] = report_tables(report, args.commit or report["commit"] or "unknown")
    save(report, args.out)
    table = markdown(report)
    args.out.with_suffix(".md").write_text(table)
    print(table, flush=True)


if __name__ == "__main__":
    main()
