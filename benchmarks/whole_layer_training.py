"""Training of the whole attention layer on a GPU at model M, in one run.

For Lq = Lkv = 4K, 16K, 64K: the public op forward + backward (tuned cache as installed) beside
dense SDPA (causal, K/V repeated to 32 heads outside the timing) with the cuDNN and the flash
backend forced, the original package's best path (4K and 16K), the lower bound and the useful
throughput (the attended (query, key) pairs' FLOPs over our time); per-kernel device times
(PyTorch profiler); max errors of O, dQ1, dQ2, dK, dV against the float64 layer (a 2048-token
slice); registers and spill stores of every compiled backward kernel; and, with ``--sanitize``,
``compute-sanitizer`` memcheck of the training problems' covering configurations at a small shape.

Run on a GPU:  PYTHONPATH=. python benchmarks/whole_layer_training.py --out whole_layer_training.json --sanitize
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
import triton
from span_forward_tiles import kernel_registers, profile
from whole_layer import ARGS, HQ, D, check_case, inputs, original_module, target_case  # this folder's helpers

from superlinear_ops.layer_api import superlinear_attention
from superlinear_ops.ops.span_attention import tile_backward as span_tc_backward
from superlinear_ops.ops.span_attention import window_backward as window_tc_backward

LENGTHS = (4096, 16384, 65536)
BACKWARD_KERNELS = (span_tc_backward.combine_rows_kernel, span_tc_backward.span_tile_backward_kernel,
                    window_tc_backward.window_dkdv_kernel, window_tc_backward.window_dq_kernel)


def training_row(n: int, original) -> dict:
    row = target_case(f"training {n}", n, n, True, original if n <= 16384 else None)  # with SDPA per backend
    row["useful_tflops"] = row["bound"]["attention_tflop"] / (row["ours_ms"] * 1e-3)
    if "kernels" not in row:  # target_case profiles only its own list of cases
        q1, q2, k, v, cp, _ = inputs(n, n, seed=4, grad=True)
        grad = torch.randn(1, HQ, n, D, device="cuda", dtype=torch.bfloat16)
        row["kernels"] = profile(lambda: torch.autograd.grad(superlinear_attention(q1, q2, k, v, cp, None, **ARGS),
                                                             (q1, q2, k, v), grad))[:12]
    print(n, {key: row.get(key) for key in ("ours_ms", "sdpa_cudnn_ms", "sdpa_flash_ms", "original_ms", "useful_tflops")},
          f"bound {row['bound']['ms']:.2f} ms", flush=True)
    return row


def registers() -> list[dict]:
    """Registers and spill stores of every compiled variant of the backward kernels in this process."""
    return kernel_registers(BACKWARD_KERNELS)


def sanitize() -> str:
    """memcheck of the training problems' covering configurations (the CLI's sanitize, one child per chunk)."""
    cmd = [sys.executable, "-m", "superlinear_ops.cli", "sanitize", "tuning/superlinear-exp-v0.1.yaml",
           "--problems", "^training", "--jobs", "15", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    summary = [line for line in done.stdout.splitlines() if "with errors" in line]
    return summary[-1] if summary else f"no summary (exit {done.returncode}): {done.stderr.strip()[-300:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="whole_layer_training.json", help="JSON results file")
    parser.add_argument("--sanitize", action="store_true", help="also run memcheck over the training problems")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("whole_layer_training.py needs a CUDA GPU; none is available")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "errors_training_2048": check_case("training 2048", 2048, 2048, 0)}
    original = original_module()
    for n in LENGTHS:
        results[f"training {n}"] = training_row(n, original)
        torch.cuda.empty_cache()
    results["registers"] = registers()
    for row in results["registers"]:
        print("registers", row, flush=True)
    if args.sanitize:
        results["memcheck"] = sanitize()
        print("memcheck:", results["memcheck"], flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
