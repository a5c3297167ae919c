"""The ``superlinear-ops`` command."""

from __future__ import annotations

import argparse
import logging
import re
import sys

from .devices import select_device

DTYPES = ("float32", "bfloat16", "float16")
OPS = ("span_forward", "span_backward", "staged_decode", "attention_layer",  # problem.OPS, for help without importing torch
       "gate_scores", "gate_scores_backward", "gate", "gate_backward")
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")  # arch_check.ARCH_LIMITS


def _demo(args: argparse.Namespace) -> int:
    import torch

    device = select_device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu":
        logging.info("no GPU in use: running the Triton kernels under Triton's interpreter (slow, small shapes)")
    from .demo import run_demo

    results = run_demo(device, dtype, seed=args.seed)
    print(f"{'step':<16}{'seconds':>10}{'max |error|':>14}{'tolerance':>12}  result")
    for r in results:
        print(f"{r.step:<16}{r.seconds:>10.3f}{r.max_error:>14.2e}{r.tolerance:>12.1e}  {'ok' if r.ok else 'FAIL'}")
    return 0 if all(r.ok for r in results) else 1


def _variants(args: argparse.Namespace) -> int:
    from .registry import REGISTRY

    for variant in REGISTRY.variants(args.op) if args.op else REGISTRY.all():
        space = ", ".join(f"{p.name} in {{{', '.join(map(str, p.values))}}}" for p in variant.space) or "no tunables"
        print(f"{variant.qualified_name}  (priority {variant.priority}{', baseline: searched only where nothing else applies' if variant.baseline else ''})")
        print(f"    {variant.description}")
        print(f"    space: {space}")
    return 0


def _problem_from_args(args: argparse.Namespace):
    from . import geometry
    from .problem import Problem
    from .registry import REGISTRY

    search_power = None if args.inv_search_power_int is not None else args.search_power
    params = geometry.power_params(search_power=search_power, inv_search_power_int=args.inv_search_power_int)
    spec = REGISTRY.spec(args.op)  # ValueError naming the known ops
    factors = (args.backward_factor, args.forward_factor, args.span_power) if spec.searching else ()
    return spec.canonical(Problem(
        op=args.op, dtype=args.dtype, head_dim=args.head_dim, q_heads=args.q_heads, kv_heads=args.kv_heads,
        spans=args.spans, queries=1 if spec.single_query else args.queries, keys=args.keys,
        batch=args.batch, masked=args.mask, sw_index=args.sw_index, power=params.label,
        device=_device(args), factors=factors,
    ))


def _device(args: argparse.Namespace):
    """The problem's device: the local one, or with ``--arch`` a GPU of that architecture (nothing runs)."""
    from .problem import DeviceIdentity, device_identity

    if getattr(args, "arch", None):
        return DeviceIdentity(f"a GPU of {args.arch}", args.arch, 1)
    return device_identity(select_device(args.device))


def _arch_lines(explanation, problem) -> list[str]:
    """The per-architecture section of ``explain``: what cannot run on the problem's GPU, and the choice."""
    from .arch_check import summary
    from .registry import REGISTRY

    if not problem.device.is_gpu:
        return []
    lines = [f"configurations that cannot run on {problem.device.arch}:"]
    for name, reasons in explanation.variants:
        variant = REGISTRY.get(problem.op, name)
        if not reasons and variant.space:
            found = summary(variant, problem)
            lines.extend([f"  {name}: {found[0]}", *(f"    {line.strip()}" for line in found[1:])] if found else [f"  {name}: none"])
    if explanation.choice is not None:
        c = explanation.choice
        reason = c.variant.compile_check(problem, c.config)
        lines.append(f"choice on {problem.device.arch}: {'cannot run: ' + reason if reason else 'fits'}")
    return lines


def _explanation_lines(problem) -> list[str]:
    """``explain`` of ``problem``, then of each part its op runs with (the layer's span attention,
    gate scores and gate), indented under the part's name."""
    from .dispatch import explain
    from .registry import REGISTRY

    explanation = explain(problem)
    lines = [explanation.text(), *_arch_lines(explanation, problem)]
    for name, part in REGISTRY.spec(problem.op).parts(problem).items():
        lines.append(f"part {name} ({part.op}):")
        lines.extend(f"    {line}" for text in _explanation_lines(part) for line in text.splitlines())
    return lines


def _explain(args: argparse.Namespace) -> int:
    if args.workload is None:
        print("\n".join(_explanation_lines(_problem_from_args(args))))
        return 0
    from .tuner.workload import load

    for case in load(args.workload).cases(_device(args)):
        print(f"== {case.label}")
        print("\n".join(_explanation_lines(case.problem)))
    return 0


def _archcheck(args: argparse.Namespace) -> int:
    import json

    from .arch_check import ARCH_LIMITS, shipped_table
    from .arch_compile import generate, report, write

    reuse = None
    if args.reuse:
        with open(args.reuse, encoding="utf-8") as f:
            reuse = json.load(f)
    if args.show:
        table = shipped_table()
    else:
        table = generate(archs=args.arch or tuple(ARCH_LIMITS), variants=args.variant or None,
                         sample=args.sample, workers=args.workers, reuse=reuse)
    if args.out:
        write(table, args.out)
    print("\n".join(report(table)))
    return 0


def _add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags describing one problem; the defaults are model M's decode at 64K (semantics section 5)."""
    parser.add_argument("--op", default="staged_decode",
                        help=f"the op: {', '.join(OPS)}, or one a plugin declares (default: staged_decode)")
    parser.add_argument("--dtype", choices=DTYPES + ("float64",), default="bfloat16", help="default: bfloat16")
    parser.add_argument("--batch", type=int, default=1, help="B (default 1)")
    parser.add_argument("--q-heads", type=int, default=32, help="Hq (default 32)")
    parser.add_argument("--kv-heads", type=int, default=2, help="Hkv (default 2)")
    parser.add_argument("--head-dim", type=int, default=128, help="D (default 128)")
    parser.add_argument("--spans", type=int, default=3, help="span slots K, topk for decode (default 3)")
    parser.add_argument("--queries", type=int, default=1, help="Lq (ignored for decode; default 1)")
    parser.add_argument("--keys", type=int, default=65536, help="Lkv (default 65536)")
    parser.add_argument("--mask", action=argparse.BooleanOptionalAction, default=False, help="an attention mask is given")
    parser.add_argument("--sw-index", type=int, default=65, help="default 65")
    parser.add_argument("--search-power", type=float, default=0.55, help="float path p (default 0.55)")
    parser.add_argument("--inv-search-power-int", type=int, default=None, help="integer path n, instead of --search-power")
    parser.add_argument("--span-power", type=float, default=0.55, help="decode span power (default 0.55)")
    parser.add_argument("--backward-factor", type=float, default=3.0, help="decode bf (default 3)")
    parser.add_argument("--forward-factor", type=float, default=1.0, help="decode ff (default 1)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``superlinear-ops`` and its subcommands."""
    from .version import __version__

    parser = argparse.ArgumentParser(
        prog="superlinear-ops",
        description="Superlinear span attention: Triton kernels checked against a PyTorch reference.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser(
        "demo",
        help="run span forward, backward and staged decode once and check them against the reference",
        description="Run the public API end to end on random inputs and compare with the float64 reference. "
        "Uses the GPU when there is one, otherwise Triton's interpreter on the CPU.",
    )
    demo.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    demo.add_argument("--dtype", choices=DTYPES, default="float32", help="input dtype (default float32)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(handler=_demo)

    variants = commands.add_parser(
        "variants", help="list every registered kernel variant with its tunable space",
        description="List the registry: each op's variants in priority order with their tunable parameters.",
    )
    variants.add_argument("--op", default=None, help=f"only this op's variants ({', '.join(OPS)}, or a plugin's)")
    variants.set_defaults(handler=_variants)

    explain = commands.add_parser(
        "explain", help="say which variant and configuration the dispatcher picks for a problem, and why",
        description="For one problem (defaults: model M's staged decode at 64K), list every variant with the "
        "reasons it does not apply, the problem's key, the lookup layers consulted and the final choice.",
    )
    _add_problem_arguments(explain)
    explain.add_argument("--workload", default=None, help="explain every problem of this workload file instead")
    explain.add_argument("--arch", choices=ARCHS, default=None,
                         help="explain for a GPU of this architecture instead of the local device (checks only)")
    explain.set_defaults(handler=_explain)

    archcheck = commands.add_parser(
        "archcheck", help="compile the tensor-core kernels for each GPU architecture and say which configurations cannot run",
        description="Compile every declared tile configuration of the covered variants (span_forward/tc_tiles, "
        "span_backward/tc_tiles; bf16/fp16, head dims 65 to 128) ahead of time for sm_80, sm_86, sm_89, sm_90, sm_100 "
        "and sm_120 (no GPU needed), record shared memory, registers, spills and tensor memory, and report the "
        "configurations over each arch's limits. --out writes the table the package ships (superlinear_ops/arch_table.json).",
    )
    archcheck.add_argument("--out", default=None, help="write the table (JSON) here")
    archcheck.add_argument("--arch", action="append", choices=ARCHS, help="only this arch (repeatable; default: all six)")
    archcheck.add_argument("--variant", action="append", default=None, help="only this op/variant (repeatable)")
    archcheck.add_argument("--sample", type=int, default=None, help="only N tile configurations per kernel part, smallest to largest")
    archcheck.add_argument("--workers", type=int, default=None, help="compiler processes (default: one per CPU)")
    archcheck.add_argument("--reuse", default=None, help="keep this earlier table's entries whose code hash still matches")
    archcheck.add_argument("--show", action="store_true", help="report the shipped table instead of compiling")
    archcheck.set_defaults(handler=_archcheck)

    from .cache.commands import add_commands as add_cache_commands
    from .tuner.commands import add_commands as add_tuner_commands

    add_tuner_commands(commands)
    add_cache_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``superlinear-ops`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    from sqlalchemy.exc import SQLAlchemyError

    from .cache.store import StoreError

    if getattr(args, "normalise_trials", False) and args.trials == 0:
        args.trials = None
    try:
        return args.handler(args)
    except re.error as err:
        print(f"error: --problems is not a valid regular expression: {err}", file=sys.stderr)
        return 2
    except SQLAlchemyError as err:
        print(f"error: cannot use that storage or cache: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    except (StoreError, ValueError, TypeError, OSError) as err:
        print(f"error: {str(err).splitlines()[0] if str(err) else err.__class__.__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
