"""The ``superlinear-ops`` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys

DTYPES = ("float32", "bfloat16", "float16")


def _select_device(requested: str | None):
    """The torch device to run on; without a GPU, switch Triton to its interpreter first."""
    import torch

    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda was asked for but PyTorch sees no GPU; use --device cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Must happen before any Triton kernel module is imported.
        os.environ["TRITON_INTERPRET"] = "1"
    return device


def _demo(args: argparse.Namespace) -> int:
    import torch

    device = _select_device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu":
        logging.info("no GPU in use: running the Triton kernels under Triton's interpreter (slow, small shapes)")
    from .demo import run_demo

    results = run_demo(device, dtype, seed=args.seed)
    print(f"{'step':<16}{'seconds':>10}{'max |error|':>14}{'tolerance':>12}  result")
    for r in results:
        print(f"{r.step:<16}{r.seconds:>10.3f}{r.max_error:>14.2e}{r.tolerance:>12.1e}  {'ok' if r.ok else 'FAIL'}")
    return 0 if all(r.ok for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``superlinear-ops`` and its subcommands."""
    from . import __version__

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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``superlinear-ops`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
