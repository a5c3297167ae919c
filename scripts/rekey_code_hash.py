"""Re-key tuned entries from the location-bound code hash to the location-free one, proving first
that each entry's code is unchanged.

    python scripts/rekey_code_hash.py BEFORE_COMMIT FILE.yaml ... [--arch-table superlinear_ops/arch_table.json]

For every entry, the hash function of BEFORE_COMMIT (read from git) is applied to this tree's code:
it must equal the entry's stored hash, so the entry was measured on exactly the code that runs
here. Only then is the stored hash replaced by today's ``code_hash`` of the same code. Any entry
whose stored hash does not match is reported and nothing is written (exit status 1).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import superlinear_ops  # noqa: E402,F401  (registers every variant)
from superlinear_ops.cache import yaml_file  # noqa: E402
from superlinear_ops.registry import REGISTRY  # noqa: E402


def _hash_before(commit: str):
    """The ``code_hash`` function of ``commit``'s tree, loaded as a module of this package."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:superlinear_ops/code_hash.py"],
                            check=True, capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("superlinear_ops._code_hash_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, "code_hash_before.py", "exec"), module.__dict__)
    return module.code_hash


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="the commit whose code_hash the stored hashes were made with")
    parser.add_argument("files", nargs="*", type=pathlib.Path, help="canonical YAML files of tuned entries")
    parser.add_argument("--arch-table", type=pathlib.Path, help="the compiled per-architecture table (JSON)")
    args = parser.parse_args()
    before = _hash_before(args.before)
    renames: dict[str, str] = {}
    mismatches = []

    def prove(op: str, name: str, stored: str, where: str) -> None:
        variant = REGISTRY.get(op, name)
        old = before(variant.launch)
        if old != stored:
            mismatches.append(f"{where}: {op}/{name} stored {stored}, the code here hashes to {old} before the change")
        renames[stored] = variant.code_hash

    for path in args.files:
        for index, entry in enumerate(yaml_file.read(path)):
            prove(entry.key.op, entry.variant, entry.provenance.kernel_hash, f"{path} entry {index}")
    if args.arch_table:
        for qualified, item in json.loads(args.arch_table.read_text())["variants"].items():
            prove(*qualified.split("/"), item["code_hash"], str(args.arch_table))
    if mismatches:
        print("\n".join(mismatches))
        return 1
    for path in [*args.files, *([args.arch_table] if args.arch_table else [])]:
        text = path.read_text()
        text = re.sub(r"\b[0-9a-f]{16}\b", lambda m: renames.get(m.group(0), m.group(0)), text)
        path.write_text(text)
    for old, new in sorted(renames.items()):
        print(f"{old} -> {new}")
    print(f"proved and re-keyed {len(renames)} variant hashes in {len(args.files)} files"
          + (" and the arch table" if args.arch_table else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
