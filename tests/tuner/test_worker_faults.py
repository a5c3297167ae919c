"""The tuner's worker after a fault that outlives its candidate: a sticky CUDA error (a stand-in on
the CPU: after it, every launch in that process fails as a broken CUDA context makes it fail) and a
worker process that dies between candidates. Either way the next candidate, a correct one, must run
in a fresh worker, pass and be able to win; the only failure recorded is the faulting candidate's."""

from __future__ import annotations

import os
import signal
import time
import traceback

import pytest
import torch
from optuna.trial import TrialState
from planted_decode import correct_decode, planted_decode_variant, register_once
from test_tuner import DECODE_ONLY as WORKLOAD

from superlinear_ops import dispatch
from superlinear_ops.buckets import key_of
from superlinear_ops.cache.store import Store
from superlinear_ops.launch import KernelConfig
from superlinear_ops.problem import STAGED_DECODE, device_identity
from superlinear_ops.registry import REGISTRY
from superlinear_ops.tuner import faults
from superlinear_ops.tuner.search import SearchSettings, open_study, params_of
from superlinear_ops.tuner.tune import open_storage, tune
from superlinear_ops.tuner.worker import CandidateWorker
from superlinear_ops.tuner.workload import load

NAME = "after_faults"
OK, STICKY = 1, 2
STICKY_TEXT = "CUDA error: an illegal memory access was encountered"
SLOW_S = 0.2  # added to each launch of block_k=16 (the default): the candidates after a fault are faster
CPU = torch.device("cpu")
_context_broken = False  # set in a worker process by a sticky fault, as a real one breaks its CUDA context


def _launch(q1, q2, k, v, cache_position, mask, settings, config):
    """The staged decode; a sticky error at ``fault=STICKY`` and at every launch after it in the process."""
    global _context_broken
    if _context_broken or config["fault"] == STICKY:
        _context_broken = True
        raise RuntimeError(STICKY_TEXT)
    if config["block_k"] == 16:
        time.sleep(SLOW_S)
    return correct_decode(q1, q2, k, v, cache_position, mask, settings, config)


PLANTED = planted_decode_variant(NAME, _launch, (OK, STICKY))


def register() -> None:
    """Worker setup (and the test's own): register the planted variant once."""
    register_once(PLANTED)


@pytest.fixture
def planted():
    register()
    yield
    REGISTRY.unregister(STAGED_DECODE, NAME)
    dispatch.DISPATCHER.clear()


def _config(fault: int, block_k: int) -> KernelConfig:
    return KernelConfig(block_k=block_k, fault=fault, num_warps=4, num_stages=2)


def _tune(tmp_path, configs: list[KernelConfig]):
    """Tune the workload with ``configs`` enqueued after the default; (result, trials by configuration, stored
    entry, stored failures by configuration). An exception from the tune fails the test as an assertion."""
    workload = tmp_path / "decode.yaml"
    workload.write_text(WORKLOAD)
    storage, cache = str(tmp_path / "study.sqlite"), str(tmp_path / "cache.sqlite")
    case = load(workload).cases(device_identity(CPU))[0]
    settings = SearchSettings(trials=1 + len(configs), sampler="random", candidate_timeout_s=60.0)
    study = open_study(open_storage(storage), key_of(case.problem), settings)
    for config in [_config(OK, 16), *configs]:
        study.enqueue_trial(params_of(PLANTED, config))
    try:
        (result,) = tune(str(workload), settings=settings, storage=storage, cache=cache, device=CPU,
                         progress=False, worker_setup=register)
    except Exception:  # the tune must go on: an error is this test's failed assertion, its traceback shown
        raise AssertionError(f"the tune raised {traceback.format_exc()}") from None
    trials = {KernelConfig({p.name: t.params[f"{NAME}.{p.name}"] for p in PLANTED.space}).text(): t
              for t in study.get_trials() if t.params.get("variant") == NAME}
    with Store.reader(cache) as store:
        entries, failures = store.entries(), {f.config.text(): f for f in store.failures()}
    return result, trials, entries, failures


def test_the_candidate_after_a_sticky_error_runs_in_a_fresh_worker_and_can_win(tmp_path, planted) -> None:
    after = _config(OK, 32)
    result, trials, entries, failures = _tune(tmp_path, [_config(STICKY, 16), after])
    sticky = trials[_config(STICKY, 16).text()]
    assert sticky.state == TrialState.FAIL and sticky.user_attrs["failure_category"] == faults.CRASH
    assert "illegal memory access" in sticky.user_attrs["failure"]
    assert trials[after.text()].state == TrialState.COMPLETE, trials[after.text()].user_attrs  # it ran and passed
    assert list(failures) == [_config(STICKY, 16).text()]  # the sticky candidate's failure alone
    assert [e.config.text() for e in entries] == [after.text()] and result.variant == NAME  # and it won


def test_a_worker_killed_between_candidates_is_replaced(tmp_path, planted, monkeypatch) -> None:
    """The worker dies after one candidate's result (killed from outside, as by the OOM killer): the
    next candidate runs in a fresh worker, is not charged with a crash, and the study goes on."""
    evaluate, starts = CandidateWorker.evaluate, []

    def then_killed(worker: CandidateWorker, name: str, config: KernelConfig):
        outcome = evaluate(worker, name, config)
        starts.append(worker.starts)
        if config["block_k"] == 16:  # after the default
            os.kill(worker._process.pid, signal.SIGKILL)
            worker._process.join(10)
        return outcome

    monkeypatch.setattr(CandidateWorker, "evaluate", then_killed)
    after = _config(OK, 32)
    result, trials, entries, failures = _tune(tmp_path, [after])
    assert trials[after.text()].state == TrialState.COMPLETE, trials[after.text()].user_attrs
    assert failures == {}
    assert starts[:2] == [1, 2]  # the candidate after the kill ran in a second worker
    assert [e.config.text() for e in entries] == [after.text()] and result.variant == NAME
