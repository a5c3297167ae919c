"""Disposable workers: planted candidates that crash, hang, compute wrong numbers, fail to compile or
exceed a resource fail alone; the tune goes on, records each failure with its category in the study
and the store, and a later tune does not retry them. Also the checks' NaN-prefilled, repeated runs,
and (on a GPU) a real Triton kernel that stores far out of bounds."""

from __future__ import annotations

import ast
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from optuna.trial import TrialState
from planted_decode import correct_decode, planted_decode_variant, register_once
from test_tuner import DECODE_ONLY as WORKLOAD
from triton.compiler.errors import CompilationError
from triton.runtime.errors import InterpreterError, OutOfResources

from superlinear_ops import dispatch
from superlinear_ops.buckets import key_of
from superlinear_ops.cache.provenance import kernel_hash
from superlinear_ops.cache.store import Store
from superlinear_ops.cli import main
from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.rules import no_check, triton_reasons
from superlinear_ops.problem import STAGED_DECODE, device_identity
from superlinear_ops.registry import REGISTRY, Variant
from superlinear_ops.tuner import faults
from superlinear_ops.tuner.runner import CandidateFailed, ProblemBench
from superlinear_ops.tuner.search import SearchSettings, open_study, params_of
from superlinear_ops.tuner.tune import open_storage, tune
from superlinear_ops.tuner.workload import load

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
NAME = "planted_faults"
LOG_ENV = "SUPERLINEAR_OPS_TEST_PLANTED_LOG"  # the planted launch appends each fault it runs here
OK, SEGV, HANG, WRONG, COMPILE, RESOURCES = range(1, 7)  # config values are positive ints
EXPECTED = {SEGV: faults.CRASH, HANG: faults.TIMEOUT, WRONG: faults.WRONG_NUMBERS, COMPILE: faults.COMPILE_ERROR,
            RESOURCES: faults.RESOURCE_LIMIT}
TIMEOUT_S = 8.0  # per candidate; a correct one takes well under a second here


def _planted_launch(q1, q2, k, v, cache_position, mask, settings, config):
    """The staged decode, or the fault ``config.fault`` names."""
    fault = config["fault"]
    if fault != OK and os.environ.get(LOG_ENV):
        with open(os.environ[LOG_ENV], "a") as log:
            log.write(f"{fault}\n")
    if fault == SEGV:
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == HANG:
        time.sleep(10 * TIMEOUT_S)
    if fault == COMPILE:
        raise CompilationError(None, ast.Pass(), "planted: unsupported tile shape")
    if fault == RESOURCES:
        raise OutOfResources(262144, 232448, "shared memory")
    out = correct_decode(q1, q2, k, v, cache_position, mask, settings, config)
    return out * 1.5 + 0.25 if fault == WRONG else out


PLANTED = planted_decode_variant(NAME, _planted_launch, tuple(range(1, 7)))


def register_planted() -> None:
    """Worker setup (and the test's own): register the planted variant once."""
    register_once(PLANTED)


@pytest.fixture
def planted(tmp_path, monkeypatch):
    register_planted()
    log = tmp_path / "planted.log"
    monkeypatch.setenv(LOG_ENV, str(log))
    yield log
    REGISTRY.unregister(STAGED_DECODE, NAME)
    dispatch.DISPATCHER.clear()


def _config(fault: int, block_k: int = 16) -> KernelConfig:
    return KernelConfig(block_k=block_k, fault=fault, num_warps=4, num_stages=2)


def _tune_enqueued(tmp_path, storage: str, cache: str, faults_first: list[int], settings: SearchSettings):
    """Tune the workload with the default, then ``faults_first``, then block_k=32 enqueued in that order."""
    workload = tmp_path / "decode.yaml"
    workload.write_text(WORKLOAD)
    case = load(workload).cases(device_identity(CPU))[0]
    study = open_study(open_storage(storage), key_of(case.problem), settings)
    for config in [_config(OK), *map(_config, faults_first), _config(OK, 32)]:
        study.enqueue_trial(params_of(PLANTED, config))
    results = tune(str(workload), settings=settings, storage=storage, cache=cache, device=CPU, progress=False,
                   worker_setup=register_planted)
    by_fault = {t.params[f"{NAME}.fault"]: t for t in study.get_trials() if t.params[f"{NAME}.block_k"] == 16}
    return results, case, by_fault, study


def test_faulting_candidates_fail_alone_and_are_not_retried(tmp_path, planted, capsys) -> None:
    cache = str(tmp_path / "cache.sqlite")
    settings = SearchSettings(trials=2 + len(EXPECTED), sampler="random", candidate_timeout_s=TIMEOUT_S)
    started = time.monotonic()
    results, case, by_fault, study = _tune_enqueued(tmp_path, str(tmp_path / "s1.sqlite"), cache, list(EXPECTED), settings)
    assert time.monotonic() - started < 10 * TIMEOUT_S  # the hang was cut at its timeout
    assert results[0].trials == 2 + len(EXPECTED) and results[0].failed == len(EXPECTED)
    for fault, category in EXPECTED.items():
        trial = by_fault[fault]
        assert trial.state == TrialState.FAIL and trial.user_attrs["failure_category"] == category, trial.user_attrs
    assert "SIGSEGV" in by_fault[SEGV].user_attrs["failure"] and "within 8 s" in by_fault[HANG].user_attrs["failure"]
    after = [t for t in study.get_trials() if t.params[f"{NAME}.block_k"] == 32]
    assert [t.state for t in after] == [TrialState.COMPLETE]  # the candidate after the crash and the hang ran
    assert by_fault[OK].state == TrialState.COMPLETE and results[0].variant == NAME
    assert "fault=1" in results[0].config
    with Store.reader(cache) as store:
        (entry,) = store.entries()
        recorded = {KernelConfig(f.config)["fault"]: f for f in store.failures()}
    assert entry.config["fault"] == OK and entry.max_error < 1e-4  # the winner is a correct candidate
    assert {f: r.category for f, r in recorded.items()} == EXPECTED
    assert all(r.kernel_hash == kernel_hash(STAGED_DECODE, NAME) and r.key == key_of(case.problem) for r in recorded.values())
    assert {int(line) for line in planted.read_text().split()} == set(EXPECTED)

    assert main(["cache", "show", "--cache", cache]) == 0
    shown = capsys.readouterr().out
    assert f"failed candidates ({len(EXPECTED)};" in shown and all(c in shown for c in EXPECTED.values())

    planted.write_text("")  # a second tune in a fresh study: the stored failures are skipped, not run
    results, _, by_fault, _ = _tune_enqueued(tmp_path, str(tmp_path / "s2.sqlite"), cache, list(EXPECTED), settings)
    assert planted.read_text() == ""
    for fault, category in EXPECTED.items():
        attrs = by_fault[fault].user_attrs
        assert by_fault[fault].state == TrialState.FAIL and attrs["known_failure"] and attrs["failure_category"] == category
        assert "not retried" in attrs["failure"]
    assert results[0].variant == NAME and "fault=1" in results[0].config


def _bench(tmp_path: pathlib.Path) -> ProblemBench:
    workload = tmp_path / "decode.yaml"
    workload.write_text(WORKLOAD)
    return ProblemBench(load(workload).cases(device_identity(CPU))[0], CPU, seed=0)


def _variant(launch) -> Variant:
    return Variant(op=STAGED_DECODE, name="planted_check", launch=launch, space=PLANTED.space, reasons=triton_reasons,
                   compile_check=no_check, default=PLANTED.default, priority=50)


def test_outputs_a_candidate_never_writes_are_caught_by_the_nan_prefill(tmp_path) -> None:
    """A launcher that leaves half of each output row unwritten passes when its fresh memory happens
    to hold the right numbers; on NaN-prefilled allocations it fails as wrong numbers."""
    def half_written(*args):
        out = _planted_launch(*args)
        result = torch.empty_like(out)
        result[..., : out.shape[-1] // 2] = out[..., : out.shape[-1] // 2]
        return result

    bench = _bench(tmp_path)
    assert bench.check(PLANTED, _config(OK)) < 1e-4
    with pytest.raises(CandidateFailed) as err:
        bench.check(_variant(half_written), _config(OK))
    assert err.value.category == faults.WRONG_NUMBERS and "relative error inf" in str(err.value)


def test_a_candidate_that_goes_wrong_on_a_later_launch_is_caught(tmp_path) -> None:
    calls = []

    def second_launch_wrong(*args):
        calls.append(1)
        out = _planted_launch(*args)
        return out + 1.0 if len(calls) == 2 else out

    with pytest.raises(CandidateFailed, match="wrong result"):
        _bench(tmp_path).check(_variant(second_launch_wrong), _config(OK))
    assert len(calls) == 2


def test_masked_decode_checks_catch_an_int64_mask_read_by_its_low_word(tmp_path) -> None:
    """Model code passes int64 masks. A masked decode problem's checks include one whose kept
    entries are 2**32: a candidate that reads it as 32-bit words (every key then hidden) fails."""
    def low_word(q1, q2, k, v, cache_position, mask, settings, config):
        narrowed = mask.to(torch.int32) if mask is not None and mask.dtype == torch.int64 else mask
        return _planted_launch(q1, q2, k, v, cache_position, narrowed, settings, config)

    workload = tmp_path / "masked.yaml"
    workload.write_text(WORKLOAD.replace("{context: 64}", "{context: 64, mask: [ones, holes]}"))
    bench = ProblemBench(load(workload).cases(device_identity(CPU))[0], CPU, seed=0)
    wide = [x.mask for x, _ in bench.checks if x.mask is not None and x.mask.dtype == torch.int64]
    assert len(wide) == 1 and bool((wide[0] != 0).any()) and not bool((wide[0].to(torch.int32) != 0).any())
    assert bench.check(PLANTED, _config(OK)) < 1e-4
    with pytest.raises(CandidateFailed, match="wrong result"):
        bench.check(_variant(low_word), _config(OK))


@pytest.mark.parametrize(("error", "category", "sticky"), [
    (OutOfResources(262144, 232448, "shared memory"), faults.RESOURCE_LIMIT, False),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), faults.RESOURCE_LIMIT, False),
    (CompilationError(None, ast.Pass(), "bad"), faults.COMPILE_ERROR, False),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), faults.CRASH, True),
    (InterpreterError("index 99 is out of bounds"), faults.CRASH, False),
    (TypeError("launch() got an unexpected keyword argument"), faults.COMPILE_ERROR, False),
])
def test_errors_are_sorted_into_categories(error, category, sticky) -> None:
    assert faults.classify(error) == category and faults.is_sticky(error) is sticky


def test_failure_categories_and_exit_descriptions() -> None:
    assert faults.describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV" and faults.describe_exit(3) == "exit status 3"
    with pytest.raises(ValueError, match="category must be one of"):
        faults.Failure("flaky", "x")
    with pytest.raises(ValueError, match="candidate_timeout_s"):
        SearchSettings(candidate_timeout_s=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (a real out-of-bounds Triton store)")
def test_a_real_illegal_memory_access_fails_only_its_trial(tmp_path) -> None:
    """scripts/gpu_fault_tune.py: a Triton kernel storing far out of bounds, tuned beside correct
    candidates, compiled for the GPU (not under the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_fault_tune.py"), "--dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "tune completed with the fault recorded" in run.stdout
