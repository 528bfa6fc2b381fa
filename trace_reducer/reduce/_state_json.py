"""Canonical JSON of the reduced state, written a piece at a time and atomically as state.json."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from rollout.trace.v1 import state_pb2

from ._compact import RequestIndex, expand_call, is_compact

# The fields of RolloutTrace that map ids to messages: the bulk of a state, written an entry at
# a time.
_MAPS = frozenset(
    field.name
    for field in state_pb2.RolloutTrace.DESCRIPTOR.fields
    if field.message_type is not None and field.message_type.GetOptions().map_entry
)
_WRITE_BYTES = 1 << 16


def _to_dict(message: Message) -> Any:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _dumps(value: Any, level: int) -> str:
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    # JSON strings hold no raw newline, so every newline is one json.dumps put between lines.
    return text.replace("\n", "\n" + "  " * level) if level else text


def _key(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)


def iter_state_json(trace: state_pb2.RolloutTrace, *, expand: bool = False) -> Iterator[str]:
    """state_to_json(trace) in pieces, one map entry at a time.

    expand: write a compact state in the complete form (expand_request_items), making one
    call's request whole at a time, so what is held never grows with the square of the
    conversation.
    """
    shell = state_pb2.RolloutTrace()
    for field, value in trace.ListFields():
        if field.name in _MAPS:
            continue
        if field.is_repeated:
            getattr(shell, field.name).extend(value)
        elif field.message_type is not None:
            getattr(shell, field.name).CopyFrom(value)
        else:
            setattr(shell, field.name, value)
    top = _to_dict(shell)
    index = RequestIndex(trace.inference_calls) if expand and is_compact(trace) else None
    yield "{"
    for number, name in enumerate(sorted(top)):
        yield ("\n  " if number == 0 else ",\n  ") + _key(name) + ": "
        entries = getattr(trace, name) if name in _MAPS else None
        if not entries:
            yield _dumps(top[name], 1)
            continue
        yield "{"
        for position, entry_key in enumerate(sorted(entries)):
            message = entries[entry_key]
            if index is not None and name == "inference_calls":
                whole = state_pb2.InferenceCall()
                whole.CopyFrom(message)
                expand_call(whole, index)
                message = whole
            yield ("\n    " if position == 0 else ",\n    ") + _key(entry_key) + ": "
            yield _dumps(_to_dict(message), 2)
        yield "\n  }"
    yield "\n}\n"


def state_to_json(trace: state_pb2.RolloutTrace) -> str:
    """proto3 JSON with snake_case names, every field shown, sorted keys, indented by 2:
    byte-stable, and what json_format.MessageToJson writes with those options (plus a newline).
    """
    return "".join(iter_state_json(trace))


def write_state_json(
    trace: state_pb2.RolloutTrace,
    path: str | os.PathLike[str],
    *,
    expand: bool = False,
    private: bool = True,
) -> Path:
    """Write the state to path so readers see the old file or the new, never half.

    expand: as for iter_state_json. private: mode 0600, as a bundle's own files; else the
    mode any new file gets (0666 less the umask), for a copy the user asked for elsewhere.
    """
    target = Path(path)
    try:
        dir_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(target)) from error
    try:
        write_state_json_at(
            trace, dir_fd, target.name, display=str(target), expand=expand, private=private
        )
    finally:
        os.close(dir_fd)
    return target


def write_state_json_at(
    trace: state_pb2.RolloutTrace,
    dir_fd: int,
    name: str,
    *,
    display: str,
    expand: bool = False,
    private: bool = True,
) -> None:
    """write_state_json into the directory open as dir_fd, whatever its path names by now.

    Neither the temporary file nor `name` is followed if it is a symlink; errors name
    `display`, the path the caller knows the file by.
    """
    temp_name = f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(
            temp_name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600 if private else 0o666,
            dir_fd=dir_fd,
        )
    except OSError as error:
        # The temp file's name means nothing to the caller; the path they gave does.
        raise OSError(error.errno, error.strerror, display) from error
    try:
        if private:
            os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", newline="", buffering=_WRITE_BYTES) as temp:
            for piece in iter_state_json(trace, expand=expand):
                temp.write(piece)
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
