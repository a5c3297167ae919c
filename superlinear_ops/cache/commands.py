"""The ``show`` and ``cache show|export|import|prune`` commands."""

from __future__ import annotations

import argparse
import logging

from . import yaml_file
from .store import Store
from .validity import failure_is_current, why_stale, why_unusable

log = logging.getLogger(__name__)


def show(args: argparse.Namespace) -> int:
    """Print the store's entries, then its failed candidates, as tables."""
    with Store.reader(args.cache) as store:
        entries = store.entries()
        failures = store.failures()
    if not entries:
        print(f"{store.url}: no entries")
    else:
        _show_entries(entries)
    if failures:
        print(f"\nfailed candidates ({len(failures)}; 'current': not retried by a tune with this code and Triton)")
        print(f"{'key':<100} {'category':<24} {'current':<8} variant: configuration: message")
        for f in failures:
            print(f"{f.key_text:<100} {f.category:<24} {'yes' if failure_is_current(f) else 'no':<8} "
                  f"{f.variant}: {f.config.text()}: {f.message[:160]}")
    return 0


def _show_entries(entries) -> None:
    print(f"{'key':<100} {'best ms':>10} {'default ms':>11} {'speedup':>8}  {'usable here':<12} variant: configuration")
    for e in entries:
        speedup = e.default_ms / e.median_ms if e.median_ms > 0 else float("nan")
        reason = why_unusable(e)
        print(f"{e.key_text:<100} {e.median_ms:>10.4f} {e.default_ms:>11.4f} {speedup:>7.2f}x  "
              f"{'yes' if reason is None else 'no':<12} {e.variant}: {e.config.text()}" + (f"  ({reason})" if reason else ""))


def export(args: argparse.Namespace) -> int:
    """Write the store's entries to a canonical YAML file."""
    with Store.reader(args.cache) as store:
        count = yaml_file.write(store.entries(), args.output)
    log.info("wrote %d entries to %s", count, args.output)
    return 0


def import_(args: argparse.Namespace) -> int:
    """Merge a YAML file into the store (faster entries win unless --force); every entry must be one
    this version can run (known op, variant and tunables), else nothing is imported."""
    entries = yaml_file.read(args.file)
    for index, entry in enumerate(entries):
        reason = why_stale(entry)
        if reason is not None and not reason.startswith("kernel source changed"):
            raise ValueError(f"{args.file}: entry {index} ({entry.key_text}): {reason}; nothing imported")
    with Store.writer(args.cache) as store:
        written = store.put_many(entries, force=args.force)
    log.info("imported %d of %d entries from %s into %s", written, len(entries), args.file, store.url)
    return 0


def prune(args: argparse.Namespace) -> int:
    """Remove entries that no machine can use with this version of the package, and failure records
    of other code or another Triton (all failure records with --failures)."""
    with Store.writer(args.cache) as store:
        stale = [(e.key_text, why_stale(e)) for e in store.entries()]
        stale = [(k, r) for k, r in stale if r is not None]
        for key, reason in stale:
            log.info("%s %s: %s", "would remove" if args.dry_run else "removing", key, reason)
        removed = 0 if args.dry_run else store.delete(k for k, _ in stale)
        old = [f for f in store.failures() if args.failures or not failure_is_current(f)]
        forgotten = 0 if args.dry_run else store.delete_failures(old)
    log.info("%d stale entries%s", len(stale), "" if args.dry_run else f", {removed} removed")
    log.info("%d failure records to forget%s", len(old), "" if args.dry_run else f", {forgotten} removed")
    return 0


def add_commands(commands) -> None:
    """Register ``show`` and ``cache ...`` on the CLI's subparsers."""
    cache_help = "store: a SQLite file or database URL (default: the user's store)"
    show_parser = commands.add_parser("show", help="list the entries of a tuned-cache store",
                                      description="List a store's tuned entries with timings and usability here.")
    show_parser.add_argument("--cache", default=None, help=cache_help)
    show_parser.set_defaults(handler=show)

    cache = commands.add_parser("cache", help="show, export, import or prune tuned-cache stores",
                                description="List stores, move tuned entries between stores and YAML files, and prune stale ones.")
    sub = cache.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    p = sub.add_parser("show", help="list a store's entries and failed candidates",
                       description="List a store's tuned entries, then the candidates that failed (not retried while current).")
    p.add_argument("--cache", default=None, help=cache_help)
    p.set_defaults(handler=show)
    p = sub.add_parser("export", help="write a store's entries to a canonical YAML file",
                       description="Write every entry of a store to a canonical, diff-friendly YAML file.")
    p.add_argument("--cache", default=None, help=cache_help)
    p.add_argument("--output", "-o", required=True, help="YAML file to write")
    p.set_defaults(handler=export)
    p = sub.add_parser("import", help="merge a YAML file into a store",
                       description="Merge a YAML file into a store: an entry replaces a slower one for its key.")
    p.add_argument("file", help="YAML file to read")
    p.add_argument("--cache", default=None, help=cache_help)
    p.add_argument("--force", action="store_true", help="replace existing entries even when they are faster")
    p.set_defaults(handler=import_)
    p = sub.add_parser("prune", help="remove entries this package version can no longer use",
                       description="Remove entries whose variant is gone or whose kernel source has changed.")
    p.add_argument("--cache", default=None, help=cache_help)
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--failures", action="store_true", help="also forget every failure record (retry those candidates)")
    p.set_defaults(handler=prune)


