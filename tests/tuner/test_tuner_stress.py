"""The tuner under stress: workload field errors, Ctrl-C during ``tune`` and concurrent first starts."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import optuna
import pytest
import torch
from optuna.trial import TrialState

from superlinear_ops.cache.store import Store
from superlinear_ops.problem import ATTENTION_LAYER, device_identity
from superlinear_ops.tuner.search import INTERRUPTED
from superlinear_ops.tuner.workload import WorkloadError, load

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOOD = """\
name: tiny
model: {batch: 1, q_heads: 2, kv_heads: 1, head_dim: 16, dtype: float32}
span:
  sw_index: 3
  inv_search_power_int: 2
  span_power: 0.5
  backward_factor: 2.0
  forward_factor: 1.0
  topk: 2
problems:
  - decode: {context: 32}
  - decode: {context: 64}
"""


def _write(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "workload.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("old", "new", "line", "words"), [
    ("name: tiny\n", "name: tiny\nbogus_top: 1\n", 2, ["unknown field 'bogus_top'", "workload"]),
    ("dtype: float32}", "dtype: float32, heads: 3}", 2, ["unknown field 'heads'", "model"]),
    ("  topk: 2\n", "  topk: 2\n  top_k: 3\n", 10, ["unknown field 'top_k'", "span"]),
    ("{context: 64}", "{context: 64, contxt: 3}", 12, ["unknown field 'contxt'", "decode"]),
    ("span_power: 0.5", "span_power: .nan", 6, ["'span_power' must be a finite number", "nan"]),
    ("forward_factor: 1.0", "forward_factor: .inf", 8, ["'forward_factor' must be a finite number", "inf"]),
    ("backward_factor: 2.0", "backward_factor: -.inf", 7, ["'backward_factor' must be a finite number"]),
    ("{context: 64}", "{context: 64}\n  - layer_prefill: {chunk: 65, keys: 64}", 13, ["'chunk' must be <= 'keys'"]),
    ("{context: 64}", "{context: 64}\n  - layer_training: {tokens: 0}", 13, ["'tokens' must be an integer >= 1"]),
    ("{context: 64}", "{context: 64}\n  - layer_prefill: {chunk: 8}", 13, ["'keys' must be an integer >= 1"]),
])
def test_workload_field_errors_name_the_field_and_its_line(tmp_path, old, new, line, words) -> None:
    assert old in GOOD
    path = _write(tmp_path, GOOD.replace(old, new))
    with pytest.raises(WorkloadError) as err:
        load(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{line}: "), message
    for word in words:
        assert word in message, message


def test_good_workload_still_loads(tmp_path) -> None:
    workload = load(_write(tmp_path, GOOD))
    assert workload.span["forward_factor"] == 1.0 and len(workload.entries) == 2
    assert all("__line" not in str(key) for key in [*workload.model, *workload.span])


def _trials(storage: str) -> list[optuna.trial.FrozenTrial]:
    summaries = optuna.get_all_study_summaries(storage)
    return [t for s in summaries for t in optuna.load_study(study_name=s.study_name, storage=storage).get_trials()]


def test_ctrl_c_during_tune_leaves_no_false_record_and_resumes(tmp_path) -> None:
    """SIGINT while the second problem's default runs in the worker: exit 130 with one line and no traceback,
    the first problem's winner stored, the interrupted trial marked (not a failure); the rerun
    measures the default again and stores finite default times."""
    workload = _write(tmp_path, GOOD)
    storage, cache = f"sqlite:///{tmp_path / 'studies.sqlite'}", str(tmp_path / "cache.sqlite")
    args = ["tune", workload, "--trials", "2", "--storage", storage, "--cache", cache, "--device", "cpu",
            "--no-progress", "--sampler", "random"]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    interrupter = textwrap.dedent("""\
        import os, signal, sys, time
        from superlinear_ops.tuner import worker
        original, original_prepare, problems, calls = worker.CandidateWorker.evaluate, worker.CandidateWorker.prepare, [], []
        def prepare(self, *args):
            problems.append(1)
            calls.clear()
            return original_prepare(self, *args)
        def evaluate(self, *args):
            calls.append(1)
            if len(problems) == 2 and len(calls) == 1:  # the second problem's first (default) trial
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)
            return original(self, *args)
        worker.CandidateWorker.prepare, worker.CandidateWorker.evaluate = prepare, evaluate
        from superlinear_ops.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    run = subprocess.run([sys.executable, "-c", interrupter, *args], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 130, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "interrupted; stored the winners of 1 of 2 problems" in run.stderr
    trials = _trials(storage)
    interrupted = [t for t in trials if INTERRUPTED in t.user_attrs]
    assert len(interrupted) == 1 and interrupted[0].state == TrialState.FAIL
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 2
    entries = Store.reader(cache).entries()
    assert len(entries) == 1 and 0 < entries[0].default_ms < float("inf")

    rerun = subprocess.run([sys.executable, "-m", "superlinear_ops.cli", *args], env=env, capture_output=True,
                           text=True, timeout=600, check=False)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "inf" not in rerun.stdout and "nan" not in rerun.stdout, rerun.stdout
    entries = Store.reader(cache).entries()
    assert len(entries) == 2
    assert all(0 < e.default_ms < float("inf") and 0 < e.median_ms < float("inf") for e in entries)


def test_two_first_starts_on_a_fresh_storage_do_not_race(tmp_path) -> None:
    """Several processes opening a fresh SQLite storage at once: every one succeeds (the schema is
    created once, under a lock file beside the database)."""
    opener = textwrap.dedent("""\
        import sys, time
        from superlinear_ops.tuner.tune import open_storage
        while time.time() < float(sys.argv[2]):
            pass
        open_storage(sys.argv[1])
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for attempt in range(3):
        database = tmp_path / f"fresh{attempt}" / "studies.sqlite"
        database.parent.mkdir()
        start = f"{__import__('time').time() + 4.0}"
        processes = [
            subprocess.Popen([sys.executable, "-c", opener, str(database), start], env=env, stderr=subprocess.PIPE,
                             text=True)
            for _ in range(4)
        ]
        for p in processes:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
        assert (database.parent / "studies.sqlite.lock").exists()
        optuna.create_study(storage=f"sqlite:///{database}", study_name="after")  # the schema is whole


def test_layer_kinds_give_whole_layer_problems(tmp_path) -> None:
    path = _write(tmp_path, GOOD + "  - layer_prefill: {chunk: 8, keys: 96}\n  - layer_training: {tokens: 48}\n")
    cases = [c for c in load(path).cases(device_identity(torch.device("cpu"))) if c.problem.op == ATTENTION_LAYER]
    assert [(c.label, c.problem.queries, c.problem.keys) for c in cases] == [
        ("layer prefill 8 over 96", 8, 96), ("layer training 48", 48, 48),
    ]
    assert all(c.problem.factors == (2.0, 1.0, 0.5) and c.problem.spans == 2 for c in cases)
    for case in cases:
        case.problem.check()
