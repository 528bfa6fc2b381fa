"""Canonical JSON of the reduced state, and writing it atomically as state.json."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from google.protobuf import json_format

from rollout.trace.v1 import state_pb2


def state_to_json(trace: state_pb2.RolloutTrace) -> str:
    """proto3 JSON with snake_case names, every field shown, sorted keys: byte-stable."""
    text = json_format.MessageToJson(
        trace,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        sort_keys=True,
        indent=2,
        ensure_ascii=False,
    )
    return text + "\n"


def write_state_json(trace: state_pb2.RolloutTrace, path: str | os.PathLike[str]) -> Path:
    """Write the state to path (mode 0600) so readers see the old file or the new, never half."""
    target = Path(path)
    data = state_to_json(trace).encode("utf-8")
    try:
        fd, temp_name = tempfile.mkstemp(
            prefix=f".{target.name}.", suffix=".tmp", dir=target.parent
        )
    except OSError as error:
        # The temp file's name means nothing to the caller; the path they gave does.
        raise OSError(error.errno, error.strerror, str(target)) from error
    try:
        with os.fdopen(fd, "wb") as temp:
            temp.write(data)
            temp.flush()
            os.fsync(temp.fileno())
        os.chmod(temp_name, 0o600)
        os.replace(temp_name, target)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror, str(target)) from error
        raise
    _sync_directory(target.parent)
    return target


def _sync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
