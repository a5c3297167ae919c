"""The tuner on the CPU interpreter: end to end, a planted broken variant, resume after kill -9,
two workers on one PostgreSQL study, workload errors, verify and bench."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import optuna
import pytest
import torch
from cache_helpers import make_entry
from optuna.trial import TrialState

import superlinear_ops
from superlinear_ops import dispatch
from superlinear_ops.buckets import key_of
from superlinear_ops.cache.store import Store, StoreError
from superlinear_ops.cli import main
from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.rules import no_check, triton_reasons
from superlinear_ops.ops.span_attention.variants import triton_forward
from superlinear_ops.ops.staged_decode.variants import staged_decode_with
from superlinear_ops.problem import STAGED_DECODE, DeviceIdentity, device_identity
from superlinear_ops.registry import REGISTRY, Param, Variant
from superlinear_ops.tuner.bench import DENSE_BACKENDS, lower_bound
from superlinear_ops.tuner.runner import make_inputs
from superlinear_ops.tuner.search import SearchSettings, study_name
from superlinear_ops.tuner.tune import open_storage, tune, unique_cases
from superlinear_ops.tuner.workload import WorkloadError, load

ROOT = pathlib.Path(__file__).resolve().parents[2]
QUICK = ROOT / "tuning" / "quick.yaml"
CPU = torch.device("cpu")

DECODE_ONLY = """\
name: decode-only
model: {batch: 1, q_heads: 2, kv_heads: 1, head_dim: 16, dtype: float32}
span: {sw_index: 3, inv_search_power_int: 2, span_power: 0.5, backward_factor: 2.0, forward_factor: 1.0, topk: 2}
problems:
  - decode: {context: 64}
"""


@pytest.fixture
def decode_workload(tmp_path) -> pathlib.Path:
    path = tmp_path / "decode.yaml"
    path.write_text(DECODE_ONLY)
    return path


@pytest.fixture
def restore_cache():
    yield
    superlinear_ops.use_cache()


def test_tune_quick_workload_end_to_end(tmp_path, restore_cache) -> None:
    """Every problem gets 3 trials that ran; configurations the static check refused (some problems
    draw them) come on top, with their reason, and the entry records every finished trial."""
    cache, storage = tmp_path / "cache.sqlite", str(tmp_path / "studies.sqlite")
    settings = SearchSettings(trials=3, seed=1)
    results = tune(str(QUICK), settings=settings, storage=storage, cache=str(cache), device=CPU, progress=False)
    cases = unique_cases(load(QUICK).cases(device_identity(CPU)))
    assert [r.label for r in results] == [c.label for c in cases]
    with Store.reader(cache) as store:
        entries = {e.key: e for e in store.entries()}
    assert set(entries) == {key_of(c.problem) for c in cases}
    for result, case in zip(results, cases):
        entry = entries[key_of(case.problem)]
        trials = optuna.load_study(study_name=study_name(key_of(case.problem), settings), storage=open_storage(storage)).trials
        assert len(_counted(trials)) == 3 and result.trials == entry.trials == len(trials)
        assert 0 < result.best_ms < float("inf") and 0 < result.default_ms < float("inf")
        assert entry.median_ms == pytest.approx(result.best_ms) and entry.default_ms == pytest.approx(result.default_ms)
    assert any(r.pruned for r in results), "no problem drew a refused configuration: the test shows nothing of them"
    for entry in entries.values():
        assert entry.provenance.interpreter and entry.key.arch == "interpreter"
        assert 0 <= entry.max_error < 1e-3 and entry.sampler == "tpe"
    superlinear_ops.use_cache(cache)
    for case in cases:
        choice = dispatch.select(case.problem)
        assert choice.source == "explicit"
        assert (choice.variant.name, choice.config) == (entries[key_of(case.problem)].variant, entries[key_of(case.problem)].config)


def _wrong_decode(*args, config):
    return staged_decode_with(triton_forward)(*args, config) * 1.5 + 0.25


PLANTED_BROKEN = Variant(
    op=STAGED_DECODE, name="planted_broken", launch=lambda *a: _wrong_decode(*a[:-1], config=a[-1]),
    space=(Param("block_k", (16, 32)), Param("num_warps", (4,)), Param("num_stages", (2,))),
    reasons=triton_reasons, compile_check=no_check,
    default=lambda problem: KernelConfig(block_k=16, num_warps=4, num_stages=2), priority=-1,
)


def register_broken() -> None:
    """Worker setup: the worker process must know the planted variant too."""
    REGISTRY.register(PLANTED_BROKEN)


def test_planted_broken_variant_is_never_chosen(tmp_path, decode_workload) -> None:
    register_broken()
    try:
        storage = str(tmp_path / "studies.sqlite")
        settings = SearchSettings(trials=8, seed=3)
        results = tune(str(decode_workload), settings=settings, storage=storage, cache=str(tmp_path / "c.sqlite"),
                       device=CPU, progress=False, worker_setup=register_broken)
        assert results[0].variant != "planted_broken"  # anything correct, never the planted one
        case = load(decode_workload).cases(device_identity(CPU))[0]
        study = optuna.load_study(study_name=study_name(key_of(case.problem), settings), storage=open_storage(storage))
        broken = [t for t in study.trials if t.params.get("variant") == "planted_broken" and "duplicate_of" not in t.user_attrs]
        assert broken, "the planted variant was never tried (it is the default: it must be)"
        for trial in broken:
            assert trial.state == TrialState.FAIL
            assert "wrong result" in trial.user_attrs["failure"] and trial.user_attrs["failure_category"] == "wrong numbers"
    finally:
        REGISTRY.unregister(STAGED_DECODE, "planted_broken")
        dispatch.DISPATCHER.clear()


def test_study_name_changes_with_the_search_space(decode_workload) -> None:
    """A new (or edited) variant starts a fresh study: stale trials are never resumed."""
    key = key_of(load(decode_workload).cases(device_identity(CPU))[0].problem)
    settings = SearchSettings()
    before = study_name(key, settings)
    REGISTRY.register(Variant(
        op=STAGED_DECODE, name="planted_new", launch=staged_decode_with(triton_forward), space=(Param("block_k", (16,)),),
        reasons=triton_reasons, compile_check=no_check, default=lambda problem: KernelConfig(block_k=16, num_warps=4, num_stages=2), priority=50,

    ))
    try:
        assert study_name(key, settings) != before
    finally:
        REGISTRY.unregister(STAGED_DECODE, "planted_new")
    assert study_name(key, settings) == before
    assert study_name(key, SearchSettings(sampler="random")) != before


def _finished(location: str) -> int:
    """Finished trials of the storage's first study, not counting configurations the static check refused."""
    storage = open_storage(location)
    summaries = optuna.get_all_study_summaries(storage)
    if not summaries:
        return 0
    study = optuna.load_study(study_name=summaries[0].study_name, storage=storage)
    return len(_counted(study.get_trials(states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED))))


def _counted(trials: list) -> list:
    """The trials that count against the budget: not those the static check refused."""
    from superlinear_ops.tuner.search import REFUSED

    return [t for t in trials if REFUSED not in t.user_attrs]


def test_resume_after_kill_9(tmp_path, decode_workload) -> None:
    storage, cache = str(tmp_path / "studies.sqlite"), str(tmp_path / "c.sqlite")
    command = [sys.executable, "-m", "superlinear_ops.cli", "tune", str(decode_workload), "--trials", "6",
               "--storage", storage, "--cache", cache, "--device", "cpu", "--no-progress"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # The first run kills itself (SIGKILL) as it hands its fourth candidate to the worker: no timing race.
    killer = (
        "import os, signal, sys\n"
        "from superlinear_ops.tuner import worker\n"
        "original, calls = worker.CandidateWorker.evaluate, []\n"
        "def evaluate(self, *args):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 4: os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return original(self, *args)\n"
        "worker.CandidateWorker.evaluate = evaluate\n"
        "from superlinear_ops.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    killed = subprocess.run([sys.executable, "-c", killer, *command[3:]], env=env, capture_output=True, timeout=600,
                            check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    done_before = _finished(storage)
    assert 2 <= done_before < 6
    assert not os.path.exists(cache) or not Store.reader(cache).entries()
    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert _finished(storage) == 6  # resumed: only the missing trials ran
    assert len(Store.reader(cache).entries()) == 1


def test_two_workers_share_one_postgresql_study(decode_workload, postgres_url) -> None:
    settings = SearchSettings(trials=6, seed=5)
    results = tune(str(decode_workload), settings=settings, storage=postgres_url, cache=postgres_url, device=CPU,
                   workers=2, progress=False)
    assert len(results) == 1 and results[0].variant != "-"
    summaries = optuna.get_all_study_summaries(open_storage(postgres_url))
    assert len(summaries) == 1  # every problem tuned once, in one shared study
    study = optuna.load_study(study_name=summaries[0].study_name, storage=postgres_url)
    finished = study.get_trials(states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED))
    assert 6 <= len(_counted(finished)) <= 7  # two workers may each finish the last trial once
    assert not [t for t in finished if t.state == TrialState.FAIL]
    with Store.reader(postgres_url) as store:
        assert len(store.entries()) == 1


def test_workers_start_after_the_store_has_its_schema(decode_workload, tmp_path, monkeypatch) -> None:
    """Fresh workers must not race to create the store's schema (PostgreSQL raises for the loser)."""
    from superlinear_ops.tuner import tune as tune_module

    cache = f"sqlite:///{tmp_path / 'fresh.sqlite'}"
    seen = []

    def workers_see_the_store(workers, workload_path, settings, storage, cache_url, only) -> None:
        try:
            with Store.reader(cache_url) as store:
                seen.append(len(store.entries()))
        except StoreError as err:
            seen.append(str(err))

    monkeypatch.setattr(tune_module, "_run_workers", workers_see_the_store)
    tune(str(decode_workload), settings=SearchSettings(trials=1, seed=5), storage=str(tmp_path / "studies.log"),
         cache=cache, device=CPU, workers=2, progress=False)
    assert seen == [0]


@pytest.mark.parametrize(
    "text,words",
    [
        ("name: x\nmodel: {batch: 1, q_heads: 3, kv_heads: 2, head_dim: 16, dtype: float32}\n", ":2: 'q_heads' must be a multiple"),
        (DECODE_ONLY.replace("dtype: float32", "dtype: int8"), ":2: 'dtype' must be one of"),
        (DECODE_ONLY.replace("topk: 2", "topk: 0"), ":3: 'topk' must be an integer >= 1"),
        (DECODE_ONLY.replace("decode: {context: 64}", "decode: {context: 64, chunk: 3}"), ":5: decode: unknown field"),
        (DECODE_ONLY.replace("decode: {context: 64}", "warmup: {context: 64}"), ":5: each problem must be one of"),
        (DECODE_ONLY.replace("inv_search_power_int: 2", "inv_search_power_int: 9"), ":3: inv_search_power_int must be one of"),
        ("name: x\n", ":1: missing mapping 'model'"),
        ("[1, 2", "not valid YAML"),
    ],
)
def test_bad_workload_files_name_the_field_and_line(tmp_path, text, words) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(WorkloadError) as err:
        load(path)
    assert words in str(err.value) and str(path) in str(err.value)


def test_shipped_workloads_load() -> None:
    model = load(ROOT / "tuning" / "superlinear-exp-v0.1.yaml")
    labels = [c.label for c in model.cases(device_identity(CPU))]
    assert "decode 1048576" in labels and "prefill 8192 over 131072" in labels and "training 16384 backward" in labels
    assert model.params.label == "float0.55" and model.cases(device_identity(CPU))[0].problem.window == 2032


def test_lower_bound_has_ceilings_for_each_device_machines_gpu() -> None:
    """The H200 and the H100 have measured ceilings (the H100's bandwidth is the lower, so its bound is
    the longer); a GPU with none gets nan and says why, never another GPU's figures."""
    workload = load(ROOT / "tuning" / "superlinear-exp-v0.1.yaml")

    def bound(gpu: str) -> tuple[float, str]:
        case = next(c for c in workload.cases(DeviceIdentity(gpu, "sm_90", 132)) if c.label == "decode 65536")
        return lower_bound(case, [make_inputs(case, CPU, seed=0)])

    (h200, _), (h100, basis) = bound("NVIDIA H200"), bound("NVIDIA H100 80GB HBM3")
    assert 0 < h200 < h100 < float("inf") and "3.0 TB/s" in basis
    unknown, why = bound("NVIDIA H800")
    assert unknown != unknown and "no peak figures" in why


def test_verify_prints_each_row_as_it_is_measured(tmp_path, capsys, monkeypatch, restore_cache) -> None:
    """A verify cut short (killed at its time limit, or failing on a later problem) has printed the rows it measured."""
    workload = tmp_path / "two.yaml"
    workload.write_text(DECODE_ONLY + "  - decode: {context: 128}\n")
    empty = tmp_path / "empty.sqlite"
    with Store.writer(empty):
        pass
    explained = []
    real = dispatch.explain

    def explain_first_only(problem):
        explained.append(problem)
        if len(explained) > 1:
            raise KeyboardInterrupt  # the run is cut short at the second problem
        return real(problem)

    monkeypatch.setattr(dispatch, "explain", explain_first_only)
    with pytest.raises(KeyboardInterrupt):
        main(["verify", str(workload), "--cache", str(empty), "--device", "cpu"])
    out = capsys.readouterr().out
    assert "decode 64" in out and "no tuned entry" in out and "decode 128" not in out


def test_verify_and_bench_commands(tmp_path, capsys, monkeypatch, decode_workload, restore_cache) -> None:
    cache = tmp_path / "c.sqlite"
    assert main(["tune", str(decode_workload), "--trials", "2", "--storage", str(tmp_path / "s.sqlite"),
                 "--cache", str(cache), "--device", "cpu", "--no-progress"]) == 0
    assert "decode 64" in capsys.readouterr().out
    case = load(decode_workload).cases(device_identity(CPU))[0]
    planted = make_entry(key=key_of(case.problem), variant="staged", config=KernelConfig(block_k=16, num_warps=1, num_stages=1))
    with Store.writer(cache) as store:
        store.put(planted, force=True)
    from superlinear_ops.tuner import runner

    def rigged(self, variant, config):  # make the cached winner look 1.3x as slow as the default
        return 1.0 if (variant, config) == (self.default_variant, self.default_config) else 1.3

    monkeypatch.setattr(runner.ProblemBench, "time_ms", rigged)
    assert main(["verify", str(decode_workload), "--cache", str(cache), "--device", "cpu", "--threshold", "0.5"]) == 0
    verified = capsys.readouterr().out
    assert "  ok (" in verified and any(f"({name}" in verified for name in DENSE_BACKENDS)  # the fastest dense backend
    assert main(["verify", str(decode_workload), "--cache", str(cache), "--device", "cpu", "--threshold", "0.2"]) == 1
    assert "FAIL: slower than the default" in capsys.readouterr().out
    empty = tmp_path / "empty.sqlite"
    with Store.writer(empty):
        pass
    args = ["verify", str(decode_workload), "--cache", str(empty), "--device", "cpu"]
    assert main(args) == 0 and "no tuned entry" in capsys.readouterr().out
    assert main([*args, "--require-all"]) == 1
    capsys.readouterr()
    monkeypatch.undo()
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", str(decode_workload), "--cache", str(cache), "--device", "cpu", "-o", str(out), "--plot", str(plot)]) == 0
    assert f"wrote {out} and {plot}" in capsys.readouterr().out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not plot.exists()  # a warning, no file, without matplotlib
    else:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["label"] == "decode 64" and rows[0]["tuned_source"] == "explicit"
    assert rows[0]["tuned_choice"] == "staged block_k=16 num_stages=1 num_warps=1" and rows[0]["sdpa_ms"] > 0 and rows[0]["default_ms"] > 0
    # Dense attention under each SDPA backend by name (a time, or why it cannot run here), the fastest named.
    by_backend = rows[0]["sdpa_by_backend"]
    assert set(DENSE_BACKENDS) <= {name.split(" (")[0] for name in by_backend}
    ran = {name: ms for name, ms in by_backend.items() if isinstance(ms, float)}
    assert ran and all(isinstance(v, str) and v.startswith("unavailable") for k, v in by_backend.items() if k not in ran)
    fastest = min(ran, key=ran.get)
    assert rows[0]["sdpa_ms"] == ran[fastest] and rows[0]["sdpa_kind"].endswith(fastest)


def test_verify_passes_a_winner_that_is_the_default_whatever_the_timer_says(tmp_path, capsys, monkeypatch,
                                                                              decode_workload, restore_cache) -> None:
    """The same configuration timed twice differs only by noise: a winner equal to the default is not
    'slower than the default'; any other winner that times slower still fails."""
    import itertools

    from superlinear_ops.tuner import runner

    case = load(decode_workload).cases(device_identity(CPU))[0]
    default = REGISTRY.fallback(case.problem)
    for config, verdict, status in ((default.default(case.problem), "ok (the winner is the default)", 0),
                                    (KernelConfig(block_k=16, num_warps=1, num_stages=1), "FAIL: slower than the default", 1)):
        calls = itertools.count()  # every other timing 30% slower: the second of each side-by-side pair
        monkeypatch.setattr(runner.ProblemBench, "time_ms", lambda self, variant, config: 1.0 + 0.3 * (next(calls) % 2))
        cache = tmp_path / f"{status}.sqlite"
        with Store.writer(cache) as store:
            store.put(make_entry(key=key_of(case.problem), variant=default.name if status == 0 else "staged", config=config))
        assert main(["verify", str(decode_workload), "--cache", str(cache), "--device", "cpu", "--threshold", "0.1"]) == status
        assert verdict in capsys.readouterr().out


def test_tune_command_options(tmp_path, capsys) -> None:
    """--sampler, --seed, --problems, --workers, --timeout and --trials 0 (until exhausted or timed out)."""
    storage, cache = tmp_path / "s.sqlite", tmp_path / "c.sqlite"
    args = ["tune", str(QUICK), "--sampler", "random", "--seed", "7", "--trials", "0", "--timeout", "3",
            "--problems", "^decode", "--workers", "1", "--storage", str(storage), "--cache", str(cache),
            "--device", "cpu", "--no-progress"]
    assert main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()[1:] if line.strip()]
    assert len(rows) == 1 and rows[0].startswith("decode 64")
    summaries = optuna.get_all_study_summaries(open_storage(str(storage)))
    assert len(summaries) == 1 and "random" in summaries[0].study_name
    with Store.reader(cache) as store:
        (entry,) = store.entries()
    assert entry.sampler == "random" and entry.seed == 7 and entry.trials >= 1


def test_rows_off_counts_the_rows_that_differ_and_nan() -> None:
    from superlinear_ops.tuner.runner import NEAR_TIE_ROWS, rows_off

    expected = torch.zeros(2, 4, 1000, 8)
    got = expected.clone()
    assert rows_off(got, expected, 1e-3) == 0.0
    got[0, 1, 7, 3] = 0.5  # one near-tie row of 8000 picked other anchors
    assert rows_off(got, expected, 1e-3) == pytest.approx(1 / 8000)
    assert rows_off(got, expected, 1e-3) > NEAR_TIE_ROWS  # 1.25e-4: more than the tuner allows
    got[0, 1, 7, 3] = 1e-4  # within tolerance
    got[1, 0, 0, 0] = float("nan")
    assert rows_off(got, expected, 1e-3) == pytest.approx(1 / 8000)


MASKED_AND_STATIC = DECODE_ONLY.replace("  - decode: {context: 64}\n", """\
  - decode: {context: 40, cache: 64}
  - decode: {context: 64, batch: 2, mask: [ones, holes, left_padding]}
""")


def test_workload_masks_and_batches_give_one_masked_problem_per_key(tmp_path) -> None:
    path = tmp_path / "masked.yaml"
    path.write_text(MASKED_AND_STATIC)
    static, masked = load(path).cases(device_identity(CPU))
    assert (static.label, static.fills, static.context) == ("decode 40 in 64 static cache", (40, 52, 64), "static cache")
    assert masked.label == "decode 64, B=2, mask ones/holes/left_padding" and masked.context == "full context"
    assert (masked.problem.batch, masked.problem.masked, masked.problem.keys) == (2, True, 64)
    assert masked.timed_inputs() == [(None, "ones"), (None, "holes"), (None, "left_padding")]


@pytest.mark.parametrize(
    "sizes,words",
    [
        ("{context: 64, mask: stripes}", ":5: 'mask' must be one of"),
        ("{context: 64, mask: [holes, holes]}", ":5: 'mask' must be one of"),
        ("{context: 64, mask: []}", ":5: 'mask' must be one of"),
        ("{context: 64, cache: 128, mask: ones}", ":5: decode: 'mask' is for a full context"),
        ("{context: 64, batch: 0}", ":5: 'batch' must be an integer >= 1"),
    ],
)
def test_bad_decode_masks_name_the_field_and_line(tmp_path, sizes, words) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(DECODE_ONLY.replace("{context: 64}", sizes))
    with pytest.raises(WorkloadError) as err:
        load(path)
    assert words in str(err.value)


def test_decode_masks_are_what_their_kinds_say() -> None:
    from superlinear_ops.ops.inputs import LEFT_PADDING, decode_mask

    gen = torch.Generator().manual_seed(0)
    keys = 4 * LEFT_PADDING
    assert decode_mask(None, 2, keys, keys, CPU, gen) is None
    assert decode_mask("ones", 2, keys, keys, CPU, gen).all()
    assert decode_mask("prefix", 2, keys, 150, CPU, gen).sum(dim=1).tolist() == [150, 150]
    padded = decode_mask("left_padding", 2, keys, keys, CPU, gen)
    assert (~padded).sum(dim=1).tolist() == [LEFT_PADDING, 2 * LEFT_PADDING] and padded[:, 2 * LEFT_PADDING:].all()
    holes = decode_mask("holes", 2, keys, keys, CPU, gen)
    assert holes[:, -1].all() and 0.03 < (~holes).double().mean().item() < 0.2 and not torch.equal(holes[0], holes[1])
    with pytest.raises(ValueError, match="mask kind"):
        decode_mask("stripes", 1, keys, keys, CPU, gen)


def record_inputs(path: str) -> None:
    """Worker setup: log every run's (position, masked keys per row) to ``path``; a timed call takes
    the fill plus the masked keys in milliseconds."""
    from superlinear_ops.tuner import runner

    seen: list[tuple[int, tuple]] = []
    original_run = runner.run

    def recording_run(variant, config, problem, x, parts):
        holes = () if x.mask is None else tuple((x.mask == 0).sum(dim=1).tolist())  # any mask dtype
        seen.append((int(x.cache_position[-1]), holes))
        with open(path, "a") as log:
            log.write(json.dumps(seen[-1]) + "\n")
        return original_run(variant, config, problem, x, parts)

    def fake_measure(call, device, graph=False):
        call()
        return float(seen[-1][0] + 1 + sum(seen[-1][1]))  # the fill plus the masked keys

    runner.run, runner.measure = recording_run, fake_measure


def test_static_caches_and_masked_contexts_are_tuned_for_the_mean_over_their_inputs(tmp_path) -> None:
    """Every candidate's time is the mean over the fills a replayed graph sees (static cache) or over
    the mask kinds (one key); the static cache's entry is stored as tuned on a static cache."""
    import functools

    from superlinear_ops.cache.layers import context_of

    path = tmp_path / "masked.yaml"
    path.write_text(MASKED_AND_STATIC)
    cache, log = tmp_path / "c.sqlite", tmp_path / "runs.jsonl"
    results = tune(str(path), settings=SearchSettings(trials=2), storage=str(tmp_path / "s.sqlite"), cache=str(cache),
                   device=CPU, progress=False, worker_setup=functools.partial(record_inputs, str(log)))
    seen = [(pos, tuple(holes)) for pos, holes in map(json.loads, log.read_text().splitlines())]
    static, masked = load(path).cases(device_identity(CPU))
    assert {s for s in seen if s[0] in (39, 51)} == {(39, (24,)), (51, (12,))}  # fills 40 and 52 of 64, B = 1
    assert results[0].best_ms == pytest.approx((40 + 24 + 52 + 12 + 64) / 3)
    kinds = {h for pos, h in seen if pos == 63 and len(h) == 2}
    holes = kinds - {(0, 0), (63, 63)}  # ones and left padding (it stops before the last key) are the others
    assert {(0, 0), (63, 63)} <= kinds and holes and all(0 < n < 20 for row in holes for n in row)
    with Store.reader(cache) as store:
        entries = {e.key: e for e in store.entries()}
    assert context_of(entries[key_of(static.problem)]) == "static cache"
    assert context_of(entries[key_of(masked.problem)]) == "full context"
    assert entries[key_of(static.problem)].sampler == "tpe/static-cache"


def _study_with(case, trials: list[tuple[dict, float]]) -> optuna.Study:
    """An in-memory study holding completed trials (params, ms) with the search's distributions."""
    study = optuna.create_study()
    for params, ms in trials:
        dists = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=ms,
                                                  user_attrs={"max_error": 0.0}))
    return study


@pytest.mark.parametrize("retimed, ran_before, stored", [({"default": 1.0, "other": 1.2}, None, "default"),
                                                         ({"default": 1.0, "other": 0.97}, None, "default"),  # within the margin
                                                         ({"default": 1.0, "other": 0.8}, None, "other"),
                                                         ({"default": 1.0, "other": 0.97}, "earlier_winner", "other"),
                                                         ({"default": 1.0, "other": 1.01}, "earlier_winner", "default"),
                                                         ({"default": 1.0, "other": 0.97}, "sibling_winner", "other"),
                                                         ({"default": 1.0, "other": 1.01}, "sibling_winner", "default")])
def test_a_winner_is_stored_only_when_faster_than_the_default_side_by_side(decode_workload, retimed, ran_before,
                                                                           stored) -> None:
    """A default timed slow once (a cold GPU) loses the study to another configuration; the
    confirmation times both again, interleaved, and the default is stored unless the other is
    faster there by more than the margin, or at all where the other is what this GPU ran when the
    study began: the winner stored before or the sibling GPU's it borrowed (the study's EARLIER or
    SIBLING, as ``run_search`` records them)."""
    from superlinear_ops.tuner.faults import Outcome
    from superlinear_ops.tuner.search import EARLIER, SIBLING, params_of
    from superlinear_ops.tuner.tune import CONFIRM_ROUNDS, confirm_winner, summarise

    case = load(decode_workload).cases(device_identity(CPU))[0]
    variant = REGISTRY.fallback(case.problem)
    default = variant.default(case.problem)
    other = default.replace(num_warps=8 if default["num_warps"] != 8 else 4)
    configs = {"default": default, "other": other}
    study = _study_with(case, [(params_of(variant, default), 5.0), (params_of(variant, other), 2.0)])
    if ran_before is not None:
        assert ran_before in (EARLIER, SIBLING)
        study.set_user_attr(ran_before, params_of(variant, other))
    calls = []

    def evaluate(name, config):
        label = next(k for k, c in configs.items() if c == config)
        calls.append(label)
        return Outcome(milliseconds=retimed[label], max_error=0.0)

    confirm_winner(case, study, evaluate)
    assert calls == ["default", "other"] * CONFIRM_ROUNDS
    result, winner = summarise(case, study)
    assert winner.config == configs[stored] and winner.variant == variant.name
    assert winner.median_ms == retimed[stored] and winner.default_ms == retimed["default"]
    assert result.config == configs[stored].text()


def test_the_winner_stored_before_is_recorded_once_as_the_study_begins(decode_workload) -> None:
    """An interrupted run stores its best trial unconfirmed, so on resume the store holds the study's own
    winner: the study keeps what was stored when it began (here nothing, and no sibling), and that winner still needs
    the margin."""
    from superlinear_ops.tuner.faults import Outcome
    from superlinear_ops.tuner.search import EARLIER, SIBLING, SearchSettings, params_of, run_search

    case = load(decode_workload).cases(device_identity(CPU))[0]
    variant = REGISTRY.fallback(case.problem)
    default = variant.default(case.problem)
    other = params_of(variant, default.replace(num_warps=8 if default["num_warps"] != 8 else 4))
    study = optuna.create_study()
    evaluate = lambda name, config: Outcome(milliseconds=1.0, max_error=0.0)  # noqa: E731
    run_search(study, case.problem, evaluate, SearchSettings(trials=1), earlier=None)
    assert EARLIER in study.user_attrs and study.user_attrs[EARLIER] is None
    run_search(study, case.problem, evaluate, SearchSettings(trials=2), earlier=other, sibling=other)  # the resume
    assert study.user_attrs.get(EARLIER) is None and study.user_attrs.get(SIBLING) is None
    assert any(t.params == other for t in study.trials), "the stored winner is still measured again"


def test_a_short_search_measures_every_variant_default_and_leaves_nothing_queued(decode_workload) -> None:
    """After the problem's default, each other tunable variant's default runs once, in the registry's
    order, while the trial budget has room (so a short search cannot miss a variant whose heuristic
    wins); a smaller budget leaves no queued trial behind for the next run."""
    from superlinear_ops.tuner.faults import Outcome
    from superlinear_ops.tuner.search import params_of, run_search, tunable_variants

    case = load(decode_workload).cases(device_identity(CPU))[0]
    fallback = REGISTRY.fallback(case.problem)
    expected = [params_of(fallback, fallback.default(case.problem))]
    for variant in tunable_variants(case.problem):
        default = variant.default(case.problem)
        if variant is not fallback and all(default[p.name] in p.values for p in variant.space):
            expected.append(params_of(variant, default))
    assert len(expected) >= 4, expected
    evaluate = lambda name, config: Outcome(milliseconds=1.0, max_error=0.0)  # noqa: E731
    study = optuna.create_study()
    run_search(study, case.problem, evaluate, SearchSettings(trials=len(expected)))
    assert [t.params for t in study.trials] == expected
    short = optuna.create_study()
    run_search(short, case.problem, evaluate, SearchSettings(trials=2))
    assert [t.params for t in short.trials] == expected[:2]
    assert all(t.state == TrialState.COMPLETE for t in short.trials)


def test_confirmation_skips_a_default_winner_and_keeps_trial_times_when_a_rerun_fails(decode_workload) -> None:
    from superlinear_ops.tuner.faults import CRASH, Failure, Outcome
    from superlinear_ops.tuner.search import params_of
    from superlinear_ops.tuner.tune import confirm_winner, summarise

    case = load(decode_workload).cases(device_identity(CPU))[0]
    variant = REGISTRY.fallback(case.problem)
    default = variant.default(case.problem)
    other = default.replace(num_warps=8 if default["num_warps"] != 8 else 4)
    best_is_default = _study_with(case, [(params_of(variant, default), 1.0), (params_of(variant, other), 2.0)])
    confirm_winner(case, best_is_default, lambda *_: pytest.fail("the default needs no confirmation"))
    assert summarise(case, best_is_default)[1].config == default
    failing = _study_with(case, [(params_of(variant, default), 5.0), (params_of(variant, other), 2.0)])
    confirm_winner(case, failing, lambda *_: Outcome(failure=Failure(CRASH, "planted")))
    _, winner = summarise(case, failing)
    assert winner.config == other and winner.median_ms == 2.0 and winner.default_ms == 5.0


def test_a_retune_measures_the_winner_stored_before_again(tmp_path, decode_workload) -> None:
    """A stored winner, stale (another kernel hash) and missing a tunable added since, is a new
    study's second trial, the missing tunable at its default; a stored variant that no longer
    applies, or a value outside the declared space, adds no trial. The study records it as the winner
    stored before."""
    from superlinear_ops.tuner.search import EARLIER, earlier_winner_params

    case = load(decode_workload).cases(device_identity(CPU))[0]
    variant = REGISTRY.fallback(case.problem)
    default = variant.default(case.problem)
    old = KernelConfig(block_k=32, num_warps=2, num_stages=2)  # no chunk: as if chunk were added since
    cache, storage = str(tmp_path / "c.sqlite"), str(tmp_path / "studies.sqlite")
    with Store.writer(cache) as store:
        store.put(make_entry(key=key_of(case.problem), variant=variant.name, config=old,
                             provenance={"kernel_hash": "0" * 16}))
    settings = SearchSettings(trials=2, seed=0)
    tune(str(decode_workload), settings=settings, storage=storage, cache=cache, device=CPU, progress=False)
    study = optuna.load_study(study_name=study_name(key_of(case.problem), settings), storage=open_storage(storage))
    assert [t.params for t in study.trials] == [
        {"variant": variant.name, **{f"{variant.name}.{name}": value for name, value in default.items()}},
        {"variant": variant.name, **{f"{variant.name}.{name}": value for name, value in {**default, **old}.items()}},
    ]
    assert study.user_attrs.get(EARLIER) == study.trials[1].params  # summarise keeps it without the margin
    assert earlier_winner_params(case.problem, "no_such_variant", old) is None
    assert earlier_winner_params(case.problem, variant.name, old.replace(block_k=512)) is None


@pytest.mark.parametrize("where", ["store", "shipped file"])
def test_a_gpu_without_its_own_winner_measures_the_one_a_sibling_gpu_won(tmp_path, decode_workload, monkeypatch, where) -> None:
    """With no entry for its own GPU, a study's second trial is the winner another GPU of the same
    architecture stored (in the store, else in a shipped file), recorded as the study's SIBLING (not
    EARLIER: it did not win here); an entry of another architecture is no sibling."""
    from superlinear_ops.cache import yaml_file
    from superlinear_ops.tuner import tune as tune_module
    from superlinear_ops.tuner.search import EARLIER, SIBLING

    case = load(decode_workload).cases(device_identity(CPU))[0]
    variant = REGISTRY.fallback(case.problem)
    default = variant.default(case.problem)
    won = default.replace(block_k=32, num_warps=2)
    key = key_of(case.problem)
    sibling = make_entry(key=key._replace(device="Sibling CPU"), variant=variant.name, config=won)
    stranger = make_entry(key=key._replace(device="Another CPU", arch="other"), variant=variant.name, config=won.replace(num_warps=1))
    cache, storage, shipped = str(tmp_path / "c.sqlite"), str(tmp_path / "studies.sqlite"), tmp_path / "shipped.yaml"
    with Store.writer(cache) as store:
        if where == "store":
            store.put_many([sibling, stranger])
    yaml_file.write([sibling, stranger] if where == "shipped file" else [], shipped)
    monkeypatch.setattr(tune_module, "shipped_files", lambda: [shipped])
    settings = SearchSettings(trials=2, seed=0)
    tune(str(decode_workload), settings=settings, storage=storage, cache=cache, device=CPU, progress=False)
    study = optuna.load_study(study_name=study_name(key, settings), storage=open_storage(storage))
    name = variant.name
    assert [t.params for t in study.trials[:2]] == [{"variant": name, **{f"{name}.{k}": v for k, v in c.items()}} for c in (default, won)]
    assert study.user_attrs.get(EARLIER) is None and study.user_attrs.get(SIBLING) == study.trials[1].params
