"""The package version: its one source (pyproject.toml reads it), importable without cycles."""

__version__ = "0.1.0"
