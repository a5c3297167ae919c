"""On a GPU: the tuner survives a real illegal memory access.

Registers a decode variant ``planted_oob`` whose ``fault`` parameter picks: 1, the staged decode
(correct); 2, first a Triton kernel that stores 2**40 elements past its buffer (an illegal memory
access, which poisons the worker's CUDA context); 3, the same store only from the third launch in a
process on (a fault that shows only after several launches). It tunes a small bf16 decode problem
with the candidates enqueued in the order default, fault 2, fault 3, a correct one, and asserts
that the tune completed, both faults are failed trials of category 'illegal access / crash' in the
study and in the store, the correct candidates completed after them, the winner is correct; then
that a second tune (a fresh study, the same store) records the faults failed without running them.

    python scripts/gpu_fault_tune.py [--dir DIR] [--timeout SECONDS]

Prints the trials and 'tune completed with the fault recorded'; exit status 0 when all holds.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import torch
import triton
import triton.language as tl
import yaml
from optuna.trial import TrialState

from superlinear_ops.buckets import key_of
from superlinear_ops.cache.store import Store
from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.rules import no_check, triton_reasons
from superlinear_ops.ops.span_attention.variants import triton_forward
from superlinear_ops.ops.staged_decode.variants import staged_decode_with
from superlinear_ops.problem import STAGED_DECODE, device_identity
from superlinear_ops.registry import REGISTRY, Param, Variant
from superlinear_ops.tuner.faults import CRASH
from superlinear_ops.tuner.search import SearchSettings, open_study, params_of
from superlinear_ops.tuner.tune import open_storage, tune
from superlinear_ops.tuner.workload import load

NAME = "planted_oob"
CORRECT, OOB_ALWAYS, OOB_LATER = 1, 2, 3
LOG_ENV = "SUPERLINEAR_OPS_PLANTED_LOG"  # each faulting launch appends its fault here
WORKLOAD = {  # a small bf16 decode problem of model M's layout
    "name": "device-fault",
    "model": {"batch": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 128, "dtype": "bfloat16"},
    "span": {"sw_index": 65, "search_power": 0.55, "span_power": 0.55, "backward_factor": 3.0, "forward_factor": 1.0,
             "topk": 3},
    "problems": [{"decode": {"context": 4096}}],
}
_decode = staged_decode_with(triton_forward)
_launches = {OOB_LATER: 0}


@triton.jit
def store_far_out_of_bounds(ptr, distance, BLOCK: tl.constexpr):
    """Store BLOCK zeros ``distance`` elements past ``ptr`` (far outside any allocation)."""
    offsets = tl.arange(0, BLOCK)
    tl.store(ptr + distance + offsets, tl.zeros([BLOCK], dtype=tl.float32))


def _planted_launch(q1, q2, k, v, cache_position, mask, settings, config):
    fault = config["fault"]
    if fault == OOB_LATER:
        _launches[OOB_LATER] += 1
    if fault == OOB_ALWAYS or (fault == OOB_LATER and _launches[OOB_LATER] >= 3):
        with open(os.environ[LOG_ENV], "a") as log:
            log.write(f"{fault}\n")
        buffer = torch.empty(16, device=q2.device, dtype=torch.float32)
        store_far_out_of_bounds[(1,)](buffer, 1 << 40, BLOCK=128)
    return _decode(q1, q2, k, v, cache_position, mask, settings,
                   KernelConfig(block_k=config["block_k"], num_warps=4, num_stages=2))


PLANTED = Variant(
    op=STAGED_DECODE, name=NAME, launch=_planted_launch,
    space=(Param("block_k", (32, 64)), Param("fault", (CORRECT, OOB_ALWAYS, OOB_LATER)), Param("num_warps", (4,)),
           Param("num_stages", (2,))),
    reasons=triton_reasons, compile_check=no_check,
    default=lambda problem: KernelConfig(block_k=32, fault=CORRECT, num_warps=4, num_stages=2), priority=-1,
)


def register_planted() -> None:
    """Worker setup: register the planted variant in this process (once)."""
    if NAME not in {v.name for v in REGISTRY.variants(STAGED_DECODE)}:
        REGISTRY.register(PLANTED)


def _config(fault: int, block_k: int = 32) -> KernelConfig:
    return KernelConfig(block_k=block_k, fault=fault, num_warps=4, num_stages=2)


def tune_once(folder: pathlib.Path, storage: str, cache: str, timeout_s: float):
    """One tune of the workload with the candidates enqueued; its results and trials, in order."""
    workload = folder / "workload.yaml"
    case = load(workload).cases(device_identity(torch.device("cuda")))[0]
    candidates = [_config(CORRECT), _config(OOB_ALWAYS), _config(OOB_LATER), _config(CORRECT, 64)]
    settings = SearchSettings(trials=len(candidates), sampler="random", candidate_timeout_s=timeout_s)
    study = open_study(open_storage(storage), key_of(case.problem), settings)
    for config in candidates:
        study.enqueue_trial(params_of(PLANTED, config))
    started = time.monotonic()
    results = tune(str(workload), settings=settings, storage=storage, cache=cache, device=torch.device("cuda"),
                   progress=False, worker_setup=register_planted)
    trials = study.get_trials()
    print(f"tune took {time.monotonic() - started:.1f} s; {results[0].label}: winner {results[0].variant} {results[0].config}")
    for t in trials:
        config = " ".join(f"{k.split('.', 1)[1]}={v}" for k, v in t.params.items() if k != "variant")
        detail = f"{t.value:.4f} ms" if t.state == TrialState.COMPLETE else \
            f"[{t.user_attrs.get('failure_category')}] {t.user_attrs.get('failure', '')[:200]}"
        print(f"  trial {t.number}: {t.state.name:<9} {config}: {detail}")
    return results, trials


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="folder for the studies and the store (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per candidate (default 240)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        print("needs a CUDA GPU and TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    folder = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="gpu-fault-tune-"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "workload.yaml").write_text(yaml.safe_dump(WORKLOAD, sort_keys=False))
    log = folder / "faults.log"
    log.write_text("")
    os.environ[LOG_ENV] = str(log)  # the worker processes inherit it
    register_planted()
    cache = str(folder / "cache.sqlite")

    results, trials = tune_once(folder, str(folder / "studies1.sqlite"), cache, args.timeout)
    states = [(t.state, t.user_attrs.get("failure_category")) for t in trials]
    assert states == [(TrialState.COMPLETE, None), (TrialState.FAIL, CRASH), (TrialState.FAIL, CRASH),
                      (TrialState.COMPLETE, None)], states
    assert results[0].variant == NAME and f"fault={CORRECT}" in results[0].config, results
    with Store.reader(cache) as store:
        recorded = sorted((KernelConfig(f.config)["fault"], f.category) for f in store.failures())
        (entry,) = store.entries()
    assert recorded == [(OOB_ALWAYS, CRASH), (OOB_LATER, CRASH)], recorded
    assert entry.config["fault"] == CORRECT and entry.max_error < 0.04, entry
    ran = sorted(set(log.read_text().split()))
    assert ran == [str(OOB_ALWAYS), str(OOB_LATER)], ran
    print(f"store: {len(recorded)} failures recorded; winner {entry.variant} {entry.config.text()} "
          f"({entry.median_ms:.4f} ms, max error {entry.max_error:.2g})")

    log.write_text("")
    _, trials = tune_once(folder, str(folder / "studies2.sqlite"), cache, args.timeout)
    known = [t for t in trials if t.user_attrs.get("known_failure")]
    assert [t.params[f"{NAME}.fault"] for t in known] == [OOB_ALWAYS, OOB_LATER], [t.user_attrs for t in trials]
    assert log.read_text() == "", "a stored failure was run again"
    print("second tune: both faults skipped as known failures")
    print("tune completed with the fault recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
