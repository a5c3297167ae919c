"""Test setup: Triton's interpreter on CPU tensors (set before Triton is imported) and input makers."""

from __future__ import annotations

import os
import uuid

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from superlinear_ops import geometry  # noqa: E402

TOLERANCES = {  # (atol, rtol) against the float64 reference, by input dtype
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Compare against a float64 expectation with the tolerance for ``dtype``; NaN never passes."""
    assert not torch.isnan(actual).any(), "NaN in the result"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol * scale, rtol=rtol * scale)


def random_spans(
    gen: torch.Generator,
    batch: int,
    heads: int,
    cache_position: torch.Tensor,
    n_spans: int,
    key_length: int,
    window: int,
    max_len: int,
    unused_fraction: float = 0.25,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random valid spans that end before each query's window; some slots unused (-1)."""
    lq = cache_position.numel()
    pos = cache_position.clamp(max=key_length - 1).view(1, 1, lq, 1)
    limit = (pos - window + 1).clamp(min=0) if window > 0 else pos + 1  # spans end before this
    shape = (batch, heads, lq, n_spans)
    end = (torch.rand(shape, generator=gen) * limit).floor().long()
    length = torch.randint(1, max_len + 1, shape, generator=gen)
    start = (end - length + 1).clamp(min=0)
    unused = (torch.rand(shape, generator=gen) < unused_fraction) | (limit <= 0).expand(shape)
    start = torch.where(unused, torch.full_like(start, -1), start)
    end = torch.where(unused, torch.full_like(end, -1), end)
    return start, end


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
def gen() -> torch.Generator:
    """A fresh generator seeded differently each run (the seed is printed on failure)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return torch.Generator().manual_seed(seed)


__all__ = ["assert_close", "geometry", "random_spans"]
