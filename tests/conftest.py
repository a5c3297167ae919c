"""Test setup: Triton's interpreter on CPU tensors (set before Triton is imported; its fp32 to bf16
conversion rounding to nearest as on the GPU), replayable seeds, and a cache environment isolated
from the user's."""

from __future__ import annotations

import os
import pathlib
import sys
import uuid

# Kernels run under Triton's interpreter, except where SUPERLINEAR_OPS_TEST_COMPILED=1 asks for compiled
# kernels on a GPU: the Gluon kernels' tests, which the interpreter cannot run.
if os.environ.get("SUPERLINEAR_OPS_TEST_COMPILED") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
# Test the package of this checkout (here and in subprocesses), whatever an editable install points at.
_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))

import pytest
import torch
from helpers import SEED_ENV, TRITON_SEARCHES, KernelSpy, SearchSpies, resolve_seed, seed_params
from interpreter_rounding import round_bf16_to_nearest

if os.environ.get("TRITON_INTERPRET") == "1":
    round_bf16_to_nearest()  # fp32 -> bf16 rounded to nearest even, as on the GPU


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "random_seeds(n): also run with n fresh random seeds (besides the fixed one)")


def pytest_generate_tests(metafunc) -> None:
    """Every test that takes ``gen`` runs with a fixed seed (plus random ones where marked), or with
    the seeds of SUPERLINEAR_OPS_TEST_SEED."""
    if "gen" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("random_seeds")
        params = seed_params(marker.args[0] if marker else 0)
        metafunc.parametrize("gen", params, indirect=True, ids=[f"seed-{p}" for p in params])


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator with a printed, replayable seed (shown with a failing test's output)."""
    seed = resolve_seed(request.param, request.node.originalname + request.node.nodeid.split("[")[-1])
    print(f"random seed: {seed} (replay: {SEED_ENV}={seed} pytest '{request.node.nodeid.split('[')[0]}')")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True, scope="session")
def code_hashes_of_the_unpatched_package() -> None:
    """Every variant's code hash, computed once before any test patches a module constant that the
    hashed code reads (``grouped_kernels.MASK_SLICE``): the hashes are cached per process, and one
    taken under a patch would make every shipped entry of that variant look stale to later tests."""
    from superlinear_ops.registry import REGISTRY

    for variant in REGISTRY.all():
        variant.code_hash


@pytest.fixture(autouse=True)
def isolated_cache_environment(tmp_path_factory, monkeypatch):
    """HOME, XDG_CACHE_HOME and SUPERLINEAR_OPS_CACHE point into a fresh temporary directory, and the
    dispatcher's layers are rebuilt from that environment, so no user store leaks into a test."""
    import superlinear_ops

    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.delenv("SUPERLINEAR_OPS_CACHE", raising=False)
    monkeypatch.delenv("SUPERLINEAR_OPS_VALIDATE", raising=False)
    superlinear_ops.use_cache()
    yield home
    monkeypatch.undo()
    superlinear_ops.use_cache()


@pytest.fixture
def postgres_url():
    """A fresh database on the PostgreSQL server that .ci/run starts (skipped when there is none)."""
    admin_url = os.environ.get("SUPERLINEAR_OPS_TEST_POSTGRES_URL")
    if not admin_url:
        if os.environ.get("SUPERLINEAR_OPS_REQUIRE_POSTGRES") == "1":
            pytest.fail("SUPERLINEAR_OPS_REQUIRE_POSTGRES=1 but SUPERLINEAR_OPS_TEST_POSTGRES_URL is not set")
        pytest.skip("no PostgreSQL server (source ci/postgres.sh && postgres_start, as .ci/run does)")
    from sqlalchemy import create_engine, text

    name = f"slops_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
    admin.dispose()


@pytest.fixture
def search_spy(monkeypatch) -> SearchSpies:
    """Every Triton layer-search kernel replaced by a KernelSpy that counts its launches."""
    spies = SearchSpies()
    for name, (module, kernel) in TRITON_SEARCHES.items():
        spies[name] = KernelSpy(getattr(module, kernel))
        monkeypatch.setattr(module, kernel, spies[name])
    return spies
