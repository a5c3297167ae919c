"""Re-key tuned entries after a change that moves code or changes how it is hashed, proving first
that the code each entry was measured on is the code that runs now.

    python scripts/rekey_code_hash.py BEFORE FILE.yaml ... [--arch-table superlinear_ops/arch_table.json]

BEFORE is the commit whose code (and hash function) the stored hashes describe. For every entry:
1. BEFORE's own hash function on BEFORE's code must give the stored hash (the entry was measured on
   that code);
2. this tree's hash function must give the same hash on BEFORE's code and on this tree's code (the
   code that runs is unchanged: the hash sees no module names, comments or docstrings).
Only then is the stored hash replaced by this tree's. Any entry that fails either proof is reported
and nothing is written (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
HASHES = ("import json, superlinear_ops; from superlinear_ops.registry import REGISTRY;"
          "print(json.dumps({v.qualified_name: v.code_hash for v in REGISTRY.all()}))")


def hashes(tree: pathlib.Path) -> dict[str, str]:
    """'op/name' -> code hash of every registered variant of the package in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", HASHES], env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def checkout(commit: str, into: pathlib.Path) -> pathlib.Path:
    """The package and shipped files of ``commit``, extracted under ``into``."""
    archive = into / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), commit, "superlinear_ops", "cache"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def stored_hashes(files: list[pathlib.Path], arch_table: pathlib.Path | None) -> list[tuple[str, str, str]]:
    """(where, 'op/name', stored hash) of every entry of ``files`` and of the arch table."""
    found = []
    for path in files:
        for index, entry in enumerate(yaml.safe_load(path.read_text())["entries"]):
            found.append((f"{path} entry {index}", f"{entry['key']['op']}/{entry['variant']}", entry["provenance"]["kernel_hash"]))
    if arch_table:
        for qualified, item in json.loads(arch_table.read_text())["variants"].items():
            found.append((str(arch_table), qualified, item["code_hash"]))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="the commit whose code and hash function the stored hashes describe")
    parser.add_argument("files", nargs="*", type=pathlib.Path, help="canonical YAML files of tuned entries")
    parser.add_argument("--arch-table", type=pathlib.Path, help="the compiled per-architecture table (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before_tree = checkout(args.before, pathlib.Path(tmp))
        measured = hashes(before_tree)  # BEFORE's hash function on BEFORE's code
        shutil.copy(ROOT / "superlinear_ops" / "code_hash.py", before_tree / "superlinear_ops" / "code_hash.py")
        before_now = hashes(before_tree)  # this tree's hash function on BEFORE's code
    now = hashes(ROOT)
    renames, failures = {}, []
    entries = stored_hashes(args.files, args.arch_table)
    for where, variant, stored in entries:
        if measured.get(variant) != stored:
            failures.append(f"{where}: {variant} stored {stored}, but {args.before}'s code hashes to {measured.get(variant)}")
        elif before_now.get(variant) != now.get(variant):
            failures.append(f"{where}: {variant}'s code changed since {args.before} ({before_now.get(variant)} -> {now.get(variant)})")
        else:
            renames[stored] = now[variant]
    if failures:
        print("\n".join(failures))
        return 1
    for path in [*args.files, *([args.arch_table] if args.arch_table else [])]:
        path.write_text(re.sub(r"\b[0-9a-f]{16}\b", lambda m: renames.get(m.group(0), m.group(0)), path.read_text()))
    for old, new in sorted(renames.items()):
        print(f"{old} -> {new}")
    print(f"proved and re-keyed {len(entries)} entries ({len(renames)} variant hashes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
