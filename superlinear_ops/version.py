"""The package version (one place: the package, the CLI and tuned entries' provenance read it)."""

__version__ = "0.1.0"
