"""The layer's spans by one Triton launch vs by the tensor ops, side by side in one process (GPU).

The public ``superlinear_attention`` at model M (prefill chunks, training forward + backward) with
the ``layer_spans`` op's implementation switched between ``anchor_spans`` (the kernel on a GPU) and
``spans_of_anchors`` (the tensor ops): medians of do_bench over 3 interleaved rounds, outputs
compared (training's gradients differ by the backward's fp32 atomic order only), and the spans
step alone.

    PYTHONPATH=. python3 scripts/spans_ab.py
"""

from __future__ import annotations

import statistics

import torch
from layer_compare import HQ, SETTINGS, interleaved_ab, public_call, warm_gpu  # this folder's model-M helpers
from prefill_compare import bench

from superlinear_ops import torch_ops
from superlinear_ops.ops.layer import steps as attention
from superlinear_ops.ops.layer.spans_kernel import spans_by_kernel

CASES = [(8192, 16384, False), (8192, 139264, False), (8192, 1048576, False), (32768, 1048576, False),
         (4096, 4096, True), (16384, 16384, True)]


def use(kernel: bool) -> None:
    torch_ops.anchor_spans = attention.anchor_spans if kernel else attention.spans_of_anchors


def spans_alone(lq: int, lkv: int, positions: torch.Tensor) -> str:
    anchors = torch.randint(-1, lkv // 2, (1, HQ, lq, 3), device="cuda")
    settings = SETTINGS.for_keys(lkv)
    mask = torch.ones(1, lkv, dtype=torch.bool, device="cuda")
    mask[0, :100] = False
    equal = all(torch.equal(a, b) for m in (None, mask) for a, b in
                zip(attention.spans_of_anchors(anchors, positions, lkv, m, settings), spans_by_kernel(anchors, positions, lkv, m, settings)))
    ops = bench(lambda: attention.spans_of_anchors(anchors, positions, lkv, None, settings)) * 1e3
    kernel = bench(lambda: spans_by_kernel(anchors, positions, lkv, None, settings)) * 1e3
    return f"; spans alone: tensor ops {ops:.1f} us, kernel {kernel:.1f} us, equal {equal}"


def main() -> None:
    warm_gpu(1.0)
    for lq, lkv, training in CASES:
        call, positions = public_call(lq, lkv, training)
        outputs, times = interleaved_ab(call, use, training)
        equal = all(torch.equal(a, b) for a, b in zip(outputs[False], outputs[True]))
        ops, kernel = statistics.median(times[False]), statistics.median(times[True])
        row = (f"{'training' if training else 'prefill'} {lq} over {lkv}: tensor ops {ops:.3f} ms, kernel {kernel:.3f} ms, "
               f"{ops / kernel:.3f}x, outputs equal {equal}")
        print(row + ("" if training else spans_alone(lq, lkv, positions)), flush=True)
        del outputs, call
        torch.cuda.empty_cache()
    use(True)


if __name__ == "__main__":
    main()
