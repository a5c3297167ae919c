"""The rules several ops' variants share: when the Triton kernels apply, the reference's limit, the
register and shared-memory estimates, and the baseline tiles.

The rules read only what a problem's key holds (bucketed sizes: the dispatcher hands them the key's
problem), so every problem of one bucket gets the same answer. None of this is launched, so none of
it enters a variant's code hash.
"""

from __future__ import annotations

from ..buckets import next_power_of_two
from ..launch import KernelConfig
from ..problem import Problem
from ..registry import Param

MAX_VALUES_PER_THREAD = 256  # fp32 tile values per thread above which kernels spill
MAX_TC_VALUES_PER_THREAD = 160  # fp32 accumulator + score values per thread of a tensor-core tile
REFERENCE_SCORE_BUDGET = 1 << 31  # scores the backward reference may materialise
SHARED_MEMORY_BYTES = {  # per thread block, by compute capability
    "sm_90": 232448, "sm_100": 232448, "sm_120": 101376, "sm_80": 166912, "sm_87": 166912,
    "sm_86": 101376, "sm_89": 101376, "sm_75": 65536, "sm_70": 98304,
}
DEFAULT_SHARED_MEMORY_BYTES = 49152

# The per-(query, span) kernels' tiles: the span forward's baseline and the staged decodes built on it.
KEY_BLOCKS = Param("block_k", (16, 32, 64, 128, 256))
WARPS = Param("num_warps", (1, 2, 4, 8))
FORWARD_SPACE = (KEY_BLOCKS, WARPS, Param("num_stages", (1, 2, 3, 4)))


def triton_reasons(problem: Problem) -> list[str]:
    """Why the Triton kernels cannot serve ``problem`` (empty when they can)."""
    reasons = []
    if not problem.device.is_gpu and not problem.device.interpreter:
        reasons.append("CPU tensors without TRITON_INTERPRET=1 run the PyTorch reference")
    if problem.dtype == "float64":
        reasons.append("float64 inputs: the Triton kernels accumulate in fp32; float64 runs the reference")
    if problem.head_dim > 256:
        reasons.append(f"head dim {problem.head_dim} > 256")
    return reasons


def misfit(problem: Problem, default, check) -> list[str]:
    """Why no configuration fits the GPU, when even ``default`` (the heuristic falls back to the
    smallest tiles) fails ``check``; else none."""
    reason = check(problem, default(problem))
    return [] if reason is None else [f"even the smallest tiles do not fit: {reason}"]


def always_applies(problem: Problem) -> list[str]:
    """No reasons: the variant serves every problem (the layer's search reference works in query
    chunks, the span forward reference in key blocks)."""
    return []


def reference_reasons(problem: Problem) -> list[str]:
    """Why the dense PyTorch backward reference is unfit (it materialises every score)."""
    scores = problem.batch * problem.q_heads * problem.queries * problem.spans * problem.keys
    if scores > REFERENCE_SCORE_BUDGET:
        return [f"the reference would materialise {scores:.3g} scores (> {REFERENCE_SCORE_BUDGET:.3g})"]
    return []


def no_check(problem: Problem, config: KernelConfig) -> str | None:
    """The reference has nothing to compile."""
    return None


def reference_default(problem: Problem) -> KernelConfig:
    """The reference has nothing to configure."""
    return KernelConfig()


def forward_default(problem: Problem) -> KernelConfig:
    """Heuristic per-(query, span) forward configuration: 64-key blocks (32 past D = 128), 4 warps, 2 stages."""
    return KernelConfig(block_k=64 if problem.head_dim <= 128 else 32, num_warps=4, num_stages=2)


def resource_check(tiles: int, problem: Problem, config: KernelConfig) -> str | None:
    """Why ``config`` cannot build or run well: register or shared-memory estimate (GPU only)."""
    if not problem.device.is_gpu:
        return None
    block_d = next_power_of_two(problem.head_dim)
    return register_reason(tiles, problem, config) or shared_reason(
        max(config.num_stages - 1, 1) * 2 * config.block_k * block_d * element_bytes(problem),
        f"{config.num_stages} stages of K/V tiles", problem)


def register_reason(tiles: int, problem: Problem, config: KernelConfig) -> str | None:
    """Why ``tiles`` [block_k x D] fp32 tiles spill on the config's warps, if they do (GPU only)."""
    block_d = next_power_of_two(problem.head_dim)
    per_thread = tiles * config.block_k * block_d / (32 * config.num_warps)
    if problem.device.is_gpu and per_thread > MAX_VALUES_PER_THREAD:
        return (
            f"registers: about {per_thread:.0f} fp32 values per thread for {tiles} [{config.block_k} x {block_d}] "
            f"tiles on {config.num_warps} warps (limit {MAX_VALUES_PER_THREAD})"
        )
    return None


def element_bytes(problem: Problem) -> int:
    """Bytes of one input element as the kernels stage it."""
    return 4 if problem.dtype == "float32" else 2


def shared_limit(problem: Problem) -> int:
    """Shared memory per thread block on the problem's GPU."""
    return SHARED_MEMORY_BYTES.get(problem.device.arch, DEFAULT_SHARED_MEMORY_BYTES)


def shared_reason(shared: int, what: str, problem: Problem) -> str | None:
    """Why ``shared`` bytes of ``what`` do not fit the GPU's shared memory, if they do not."""
    limit = shared_limit(problem)
    if shared > limit:
        return f"shared memory: about {shared} bytes for {what} > {limit} on {problem.device.arch}"
    return None
