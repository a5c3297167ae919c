"""Ahead-of-time compilation of the registered Triton kernels for GPUs this machine does not have.

For each covered variant (``covered()``: the variants that declare ``compiled_parts``) and each kernel
part (a kernel, or kernels, reading only its own four tunables), every distinct value of those tunables is compiled with ``triton.compile`` for
each architecture of ``arch_check.ARCH_LIMITS`` (no GPU needed: ptxas ships with Triton) and its
resources are recorded: shared memory (Triton's dynamic allocation plus the static shared memory
ptxas reports), registers per thread, spill-store bytes and tensor-memory columns (sm_100), or the
compile error. ``generate`` writes that table (``arch_check`` reads it).

Signatures follow what the launchers pass for the covered problem class (``DTYPE``, ``BLOCK_D``,
unmasked, the span slots each variant compiles for): pointers and strides 16-divisible as Triton specialises them.
The kernels with a tensor-memory-accelerator path (the forward's, the window dQ kernel and the
window dK/dV kernel's query tiles) are compiled with pointer loads throughout (``KV_TMA`` and
``ROWS_TMA`` off: what GPUs before sm_90 run, and some tiles under a mask); their TMA path holds
the same stages in shared memory and fewer addresses in registers.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import multiprocessing
import os
import re
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from .arch_check import ARCH_LIMITS, TABLE_FORMAT, TC_TUNABLES, Resources, config_key, part_tiles, table_key
from .registry import REGISTRY, KernelSpec

log = logging.getLogger(__name__)

DTYPE = "bfloat16"  # 16-bit inputs: the table serves bfloat16 and float16 problems
BLOCK_D = 128  # padded head dim: the table serves head dims 65 to 128 (model M: 128)
_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
INPUT_POINTERS = frozenset({"Q_ptr", "Qs_ptr", "K_ptr", "V_ptr", "dO_ptr", "dOs_ptr", "Out_ptr", "dQout_ptr", "dKout_ptr", "dVout_ptr"})
INT32_POINTERS = frozenset({"lo_ptr", "hi_ptr", "perm_ptr", "rank_ptr", "first_ptr", "last_ptr", "tile_lo_ptr", "tile_hi_ptr",
                            "suffix_ptr", "spos_ptr", "cache_pos_ptr"})  # positions: LaunchGeometry's int32
INT64_POINTERS = frozenset({"order_ptr"})
UNUSED_DESCRIPTORS = frozenset({"k_desc", "v_desc", "q_desc", "do_desc"})  # the tensors again when KV_TMA / ROWS_TMA is off
FLOATS = frozenset({"qk_scale", "sm_scale"})


def covered() -> dict[str, dict[str, tuple[KernelSpec, ...]]]:
    """'op/name' -> part -> kernels, for every registered variant that declares compiled parts."""
    return {v.qualified_name: v.compiled_parts for v in REGISTRY.all() if v.compiled_parts}


def _pointer_type(name: str, dtype: str) -> str:
    if name in INPUT_POINTERS or name in UNUSED_DESCRIPTORS:
        return "*" + _TRITON_TYPES[dtype]
    if name in INT32_POINTERS:
        return "*i32"
    if name in INT64_POINTERS:
        return "*i64"
    return "*i8" if name == "mask_ptr" else "*fp32"


def signature(kernel, constexprs: dict, dtype: str) -> tuple[dict, dict]:
    """(signature, attrs) of ``kernel``'s launch: pointers and strides 16-divisible, ints i32."""
    types, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            types[name] = "constexpr"
        elif name.endswith("_ptr") or name in UNUSED_DESCRIPTORS:
            types[name] = _pointer_type(name, dtype)
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            types[name] = "fp32"
        else:
            types[name] = "i32"
            if name.startswith("stride"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    return types, attrs


_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores")


def compile_one(spec: KernelSpec, arch: str, tiles: Sequence[int], dtype: str = DTYPE, block_d: int = BLOCK_D) -> Resources:
    """Compile ``spec`` with part tiles (block_m, block_n, warps, stages) for ``arch`` ('sm_90')."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    m, n, warps, stages = tiles
    kernel = spec.kernel()
    constexprs = spec.constexprs(m, n, block_d)
    types, attrs = signature(kernel, constexprs, dtype)
    output = io.StringIO()
    try:
        with knobs.nvidia.scope(), contextlib.redirect_stdout(output):
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(
                ASTSource(fn=kernel, signature=types, constexprs=constexprs, attrs=attrs),
                target=GPUTarget("cuda", int(arch.removeprefix("sm_")), 32),
                options=dict(num_warps=warps, num_stages=stages),
            )
    except Exception as err:  # noqa: BLE001 - any compile failure is this configuration's result
        return Resources(error=f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:200])
    used = _PTXAS_USED.search(output.getvalue())
    spill = _PTXAS_SPILL.search(output.getvalue())
    if used is None:
        return Resources(error="no ptxas resource report (was the kernel taken from Triton's cache?)")
    metadata = compiled.metadata
    return Resources(
        shared=int(metadata.shared) + int(used.group(2) or 0), registers=int(used.group(1)),
        spills=int(spill.group(1)) if spill else 0, tmem=int(getattr(metadata, "tmem_size", 0) or 0),
        threads=32 * warps,
    )


def _job(args: tuple) -> tuple[tuple, list]:
    variant, part, arch, tiles, dtype, block_d = args
    return args, [compile_one(spec, arch, tiles, dtype, block_d).encode() for spec in covered()[variant][part]]


def part_values(variant: str, part: str) -> list[tuple[int, ...]]:
    """The distinct (block_m, block_n, warps, stages) that ``variant``'s declared configurations give ``part``."""
    op, name = variant.split("/")
    names = [f"{part}_{t}" for t in TC_TUNABLES]
    return sorted({tuple(config[k] for k in names) for config in REGISTRY.get(op, name).configs()})


def spread(values: list, count: int | None) -> list:
    """``count`` of ``values`` evenly spaced from the first to the last (all of them for None)."""
    if count is None or count >= len(values):
        return values
    if count < 1:
        raise ValueError(f"sample must be a positive int, got {count}")
    return [values[round(i * (len(values) - 1) / max(count - 1, 1))] for i in range(count)]


def report(table: dict) -> list[str]:
    """Readable lines: per variant, arch and part, the tile sets that cannot run and why, and how many
    of the variant's declared configurations that rules out."""
    lines = [f"table {table.get('key')} (Triton {table.get('triton')}; {table.get('generation_s', '?')} s to generate)"]
    for variant, entry in sorted(table.get("variants", {}).items()):
        op, name = variant.split("/")
        configs = list(REGISTRY.get(op, name).configs())
        for arch in table["archs"]:
            bad_parts, details = {}, []
            for part, data in entry["parts"].items():
                results = data["results"].get(arch, {})
                bad_parts[part] = {key for key, values in results.items() if any(
                    Resources.decode(v).misfit(arch) for v in values)}
                for key in sorted(bad_parts[part]):
                    why = "; ".join(f"{k} {m}" for k, v in zip(data["kernels"], results[key])
                                    if (m := Resources.decode(v).misfit(arch)))
                    details.append(f"    {part} {key}: {why}")
                worst = max((Resources.decode(v).shared for vs in results.values() for v in vs), default=0)
                details.insert(0, f"    {part}: {len(bad_parts[part])} of {len(results)} tile sets cannot run (largest shared memory {worst})")
            ruled_out = sum(1 for c in configs if any(part_tiles(p, c) in bad for p, bad in bad_parts.items()))
            lines.append(f"{variant} on {arch}: {ruled_out} of {len(configs)} declared configurations cannot run")
            lines.extend(details)
    return lines


def generate(
    archs: Sequence[str] = tuple(ARCH_LIMITS),
    variants: Sequence[str] | None = None,
    sample: int | None = None,
    workers: int | None = None,
    reuse: dict | None = None,
    dtype: str = DTYPE,
    block_d: int = BLOCK_D,
) -> dict:
    """The table for ``archs`` x ``variants`` (``sample``: only the first N tiles of each part);
    entries of ``reuse`` (an earlier table) with the same code hash are kept, not recompiled, and so
    are its other variants whose code hash still matches (regenerating one variant keeps the rest)."""
    coverage = covered()
    variants = tuple(coverage) if variants is None else variants
    for arch in archs:
        if arch not in ARCH_LIMITS:
            raise ValueError(f"archs: {arch!r} is not one of {tuple(ARCH_LIMITS)}")
    for variant in variants:
        if variant not in coverage:
            raise ValueError(f"variants: {variant!r} is not one of {tuple(coverage)}")
    import triton

    started = time.monotonic()
    old = (reuse or {}).get("variants", {}) if reuse and reuse.get("key") == table_key(dtype, block_d) else {}
    table = {"format": TABLE_FORMAT, "triton": triton.__version__, "key": table_key(dtype, block_d),
             "archs": list(archs), "variants": {}}
    jobs = []
    for variant in variants:
        op, name = variant.split("/")
        code_hash = REGISTRY.get(op, name).code_hash
        kept = old.get(variant, {}) if old.get(variant, {}).get("code_hash") == code_hash else {}
        entry = table["variants"][variant] = {"code_hash": code_hash, "parts": {}}
        for part, specs in coverage[variant].items():
            results = entry["parts"][part] = {"kernels": [s.name for s in specs], "results": {a: {} for a in archs}}
            values = spread(part_values(variant, part), sample)
            for arch in archs:
                earlier = kept.get("parts", {}).get(part, {}).get("results", {}).get(arch, {})
                for tiles in values:
                    if config_key(tiles) in earlier:
                        results["results"][arch][config_key(tiles)] = earlier[config_key(tiles)]
                    else:
                        jobs.append((variant, part, arch, tiles, dtype, block_d))
    for variant, entry in old.items():  # the variants not asked for, where the code has not changed
        if variant in coverage and variant not in table["variants"] and entry.get("code_hash") == REGISTRY.get(*variant.split("/")).code_hash:
            table["variants"][variant] = entry
    log.info("compiling %d kernel parts (%d reused)", len(jobs), sum(
        len(r) for v in table["variants"].values() for p in v["parts"].values() for r in p["results"].values()))
    with tempfile.TemporaryDirectory() as cache, _environment(TRITON_CACHE_DIR=cache, TRITON_INTERPRET="0"):
        with ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn")) as pool:
            for done, ((variant, part, arch, tiles, *_), encoded) in enumerate(pool.map(_job, jobs, chunksize=4), 1):
                table["variants"][variant]["parts"][part]["results"][arch][config_key(tiles)] = encoded
                if done % 50 == 0:
                    log.info("compiled %d of %d (%.0f s)", done, len(jobs), time.monotonic() - started)
    table["generation_s"] = round(time.monotonic() - started, 1)
    return table


@contextlib.contextmanager
def _environment(**values: str):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def write(table: dict, path: str) -> None:
    """Write ``table`` as JSON, one part's results per line-ish (sorted keys, compact)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table, f, sort_keys=True, separators=(",", ":"))
        f.write("\n")
