"""What leaves the house: OpenTelemetry GenAI spans over OTLP, and RL training files."""

from typing import TYPE_CHECKING

from ._rl import FORMATS as RL_FORMATS
from ._rl import Exported, ExportError, build_sample, export_rl

if TYPE_CHECKING:
    from ..bundle._errors import ExportConfigError, ExportFailedError
    from ._otel import ExportedBundle, export_otlp

# The OTLP export needs the optional `otel` extra: it is imported on first use only.
OTEL_NAMES = frozenset({"ExportConfigError", "ExportFailedError", "ExportedBundle", "export_otlp"})


def __getattr__(name: str) -> object:
    if name in OTEL_NAMES:
        from . import _otel

        return getattr(_otel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "RL_FORMATS",
    "ExportConfigError",
    "ExportError",
    "ExportFailedError",
    "Exported",
    "ExportedBundle",
    "build_sample",
    "export_otlp",
    "export_rl",
]
