"""A GPU's benchmark report in Markdown, generated from its results JSON (``superlinear-ops bench --report``).

The results file (``docs/benchmarks/<gpu>.json``) holds one GPU's current figures::

    {
      "schema": 1,
      "device": "NVIDIA H200",                  # torch.cuda.get_device_name()
      "arch": "sm_90",
      "title": "superlinear-ops on an NVIDIA H200",
      "setup": "what every table shares: model, dtype, timing method",
      "tables": [
        {
          "title": "Whole layer, prefill",
          "date": "2026-12-04",                 # when it was measured
          "commit": "87be53a",                  # the commit it was measured at (or that recorded it)
          "command": "python3 benchmarks/whole_layer.py ...",
          "units": "ms",                        # or "us"
          "dense_backend": "cuDNN",             # the SDPA backend in the "dense" column
          "bound": "max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s)",
          "columns": {"original": "superlinear 0.1.0"},   # optional extra columns, in order
          "notes": ["one sentence per bullet"],             # optional
          "rows": [{"case": "8192 over 16,384 keys", "ours": 1.97, "bound": 0.71, "dense": 2.79,
                    "original": 13.2}]
        }
      ]
    }

``ours``, ``bound`` and ``dense`` are times in the table's units (null where not measured); an extra
column's values are numbers in the same units or short strings. The report is deterministic: the
checked-in reports are compared with what this module generates from the checked-in JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

SCHEMA = 1
TABLE_FIELDS = ("title", "date", "commit", "command", "units", "dense_backend", "bound", "rows")
ROW_FIELDS = ("case", "ours", "bound", "dense")


def _check(results: dict) -> None:
    """Raise ValueError naming the first missing or malformed field."""
    if results.get("schema") != SCHEMA:
        raise ValueError(f"results: schema must be {SCHEMA}, got {results.get('schema')!r}")
    for field in ("device", "title", "tables"):
        if field not in results:
            raise ValueError(f"results: missing field {field!r}")
    for i, table in enumerate(results["tables"]):
        where = f"tables[{i}] ({table.get('title', 'untitled')})"
        for field in TABLE_FIELDS:
            if field not in table:
                raise ValueError(f"{where}: missing field {field!r}")
        if table["units"] not in ("ms", "us"):
            raise ValueError(f"{where}: units must be 'ms' or 'us', got {table['units']!r}")
        for j, row in enumerate(table["rows"]):
            for field in ROW_FIELDS:
                if field not in row:
                    raise ValueError(f"{where}, rows[{j}]: missing field {field!r}")


def fmt(value) -> str:
    """A time in a table: three or four significant figures, thousands grouped; '-' when absent."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.1f}"
    if size >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _ratio(numerator, denominator) -> str:
    if numerator is None or denominator is None or denominator == 0:
        return "-"
    return f"{numerator / denominator:.2f}x"


def render_table(table: dict) -> list[str]:
    """One table's section: heading, provenance line, the table, its notes."""
    units = table["units"]
    extra = table.get("columns", {})
    lines = [
        f"## {table['title']}",
        "",
        f"Measured {table['date']} at commit `{table['commit']}` with `{table['command']}`. Times in {units}. "
        f"Dense: `scaled_dot_product_attention`, backend {table['dense_backend']}. Lower bound: {table['bound']}.",
        "",
    ]
    header = ["case", f"ours ({units})", "lower bound", f"dense ({table['dense_backend']})", "dense / ours",
              *extra.values()]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("| --- | " + " | ".join("---:" for _ in header[1:]) + " |")
    for row in table["rows"]:
        cells = [row["case"], fmt(row["ours"]), fmt(row["bound"]), fmt(row["dense"]), _ratio(row["dense"], row["ours"]),
                 *(fmt(row.get(key)) for key in extra)]
        lines.append("| " + " | ".join(cells) + " |")
    notes = table.get("notes", [])
    if notes:
        lines.append("")
        lines.extend(f"- {note}" for note in notes)
    lines.append("")
    return lines


def render(results: dict, source: str = "results JSON") -> str:
    """The Markdown report of ``results`` (a parsed results file); ``source`` names the file in its header."""
    _check(results)
    arch = f" ({results['arch']})" if results.get("arch") else ""
    latest = max(table["date"] for table in results["tables"]) if results["tables"] else "-"
    lines = [
        f"# {results['title']}",
        "",
        f"Generated from `{source}` beside this file by `superlinear-ops bench --report`; edit the JSON, not this file.",
        f"GPU: {results['device']}{arch}. Latest measurement: {latest}. "
        "\"dense / ours\" above 1 means superlinear-ops is faster.",
        "",
    ]
    if results.get("setup"):
        lines.extend([results["setup"], ""])
    for table in results["tables"]:
        lines.extend(render_table(table))
    return "\n".join(lines).rstrip("\n") + "\n"


def write_report(results_path: str | Path, out_path: str | Path | None = None) -> Path:
    """Read a results JSON file and write its Markdown report (default: beside it, ``.md``); return the path."""
    results_path = Path(results_path)
    with open(results_path, encoding="utf-8") as fh:
        results = json.load(fh)
    out = Path(out_path) if out_path is not None else results_path.with_suffix(".md")
    text = render(results, source=results_path.name)
    out.write_text(text, encoding="utf-8")
    return out
