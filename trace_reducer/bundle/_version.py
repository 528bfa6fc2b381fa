"""The package version, kept apart so every module can import it without cycles."""

from importlib import metadata

try:
    __version__ = metadata.version("rollout-trace")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"
