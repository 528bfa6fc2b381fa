"""Canonical JSON of the reduced state, and writing it atomically as state.json."""

from __future__ import annotations

import contextlib
import os
import secrets
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
    try:
        dir_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(target)) from error
    try:
        write_state_json_at(trace, dir_fd, target.name, display=str(target))
    finally:
        os.close(dir_fd)
    return target


def write_state_json_at(
    trace: state_pb2.RolloutTrace, dir_fd: int, name: str, *, display: str
) -> None:
    """write_state_json into the directory open as dir_fd, whatever its path names by now.

    Neither the temporary file nor `name` is followed if it is a symlink; errors name
    `display`, the path the caller knows the file by.
    """
    data = state_to_json(trace).encode("utf-8")
    temp_name = f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(
            temp_name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dir_fd,
        )
    except OSError as error:
        # The temp file's name means nothing to the caller; the path they gave does.
        raise OSError(error.errno, error.strerror, display) from error
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as temp:
            temp.write(data)
            temp.flush()
            os.fsync(temp.fileno())
        os.replace(temp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temp_name, dir_fd=dir_fd)
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror, display) from error
        raise
    # The rename is durable only once the directory entry is.
    with contextlib.suppress(OSError):
        os.fsync(dir_fd)
