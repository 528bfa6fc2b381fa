"""The TOML configuration file: the flags of `agent-server serve` and `gateway`, as `name = value`
lines."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from grpc_common._files import read_given_file

# Every key a file may set: the flag's name without its dashes, and the type of its value
# (`list`: a list of strings, as a repeatable flag gives; `bool`: a flag that takes no value).
# Every flag of `serve` and `gateway` but --config has one (tests/agent_server/test_config.py);
# the gateway's --listen is `gateway-listen` here and its --upstream is `provider-url`.
KEYS: dict[str, type] = {
    "listen": str,
    "provider-url": str,
    "provider-api": str,
    "model": str,
    "api-key-env": str,
    "trace-root": Path,
    "max-retries": int,
    "retry-base-delay": float,
    "stream-idle-timeout": float,
    "event-buffer": int,
    "local-word-delay": float,
    "closed-thread-retention": float,
    "max-closed-threads": int,
    "provider-max-connections": int,
    "max-tool-rounds": int,
    "tool-output-timeout": float,
    "auth-token-env": str,
    "tls-cert": Path,
    "tls-key": Path,
    "keepalive-time": float,
    "max-connection-age": float,
    "metrics-listen": str,
    "otlp-endpoint": str,
    "otlp-protocol": str,
    "otlp-header": list,
    "otlp-include-content": bool,
    "log-level": str,
    "log-format": str,
    "event-loop": str,
    "replay-from": Path,
    "replay-pace": str,
    "replay-on-divergence": str,
    "replay-branch-at": int,
    "workers": int,
    # `agent-server gateway` only.
    "gateway-listen": str,
    "session-idle-timeout": float,
    "token-ids": bool,
    "request-body-budget": int,
}


# The keys of a `[providers.NAME]` table and their types.
PROVIDER_KEYS: dict[str, type] = {"url": str, "api": str, "model": str, "key-env": str}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


# Far beyond any settings file: what is larger is refused unread.
MAX_CONFIG_BYTES = 1 << 20


class ConfigFileError(ValueError):
    """The file cannot be read, is not TOML, or sets something it may not."""


def load(path: Path) -> dict[str, Any]:
    """The file's settings by attribute name (`provider_url`); relative paths in it are taken
    from the file's own directory, so the file means the same from wherever it is used."""
    try:
        # Read up to a bound: a settings file is small, and a path such as /dev/zero is not
        # one (read whole, it took every byte of memory). A pipe (`--config <(...)`) is read;
        # a FIFO, a directory or a device is said to be one (a FIFO was waited on for ever).
        data = read_given_file(path, "--config", limit=MAX_CONFIG_BYTES)
    except ValueError as error:
        raise ConfigFileError(str(error)) from error
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigFileError(
            f"--config: {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a settings file"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigFileError(f"--config: cannot read {path}: not UTF-8 text") from error
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigFileError(f"--config: {path} is not valid TOML: {error}") from error
    except RecursionError as error:
        # tomllib parses nested arrays and tables by recursion (was: a RecursionError traceback).
        raise ConfigFileError(f"--config: {path} is not valid TOML: nested too deeply") from error
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key == "providers":
            values["providers"] = _providers(path, value)
            continue
        kind = KEYS.get(key)
        if kind is None:
            known = ", ".join(sorted([*KEYS, "providers"]))
            raise ConfigFileError(f"--config: {path}: unknown setting {key!r} (known: {known})")
        values[key.replace("-", "_")] = _typed(path, key, value, kind)
    return values


def _providers(path: Path, value: Any) -> dict[str, dict[str, Any]]:
    """`[providers.NAME]` tables: url (required), api, model, key-env, capabilities."""
    if not isinstance(value, dict):
        raise ConfigFileError(f"--config: {path}: providers must be tables [providers.NAME]")
    out: dict[str, dict[str, Any]] = {}
    for name, table in value.items():
        if not _NAME.fullmatch(name):
            # Quoted as the unknown keys are: a name holding an escape sequence is shown as
            # `\x1b`, never written for the terminal to act on.
            raise ConfigFileError(
                f"--config: {path}: [providers] {name!r}: a name is 1 to 64 letters, digits, "
                "'_' or '-'"
            )
        where = f"[providers.{name}]"
        if not isinstance(table, dict):
            raise ConfigFileError(f"--config: {path}: {where} must be a table")
        entry: dict[str, Any] = {}
        for key, setting in table.items():
            if key == "capabilities":
                if not isinstance(setting, list) or not all(isinstance(c, str) for c in setting):
                    raise ConfigFileError(
                        f"--config: {path}: {where} capabilities must be a list of strings"
                    )
                entry[key] = list(setting)
                continue
            if key not in PROVIDER_KEYS:
                known = ", ".join(sorted([*PROVIDER_KEYS, "capabilities"]))
                raise ConfigFileError(
                    f"--config: {path}: {where}: unknown setting {key!r} (known: {known})"
                )
            entry[key] = _typed(path, f"{where} {key}", setting, PROVIDER_KEYS[key])
        if "url" not in entry:
            raise ConfigFileError(f"--config: {path}: {where} needs a url")
        out[name] = entry
    return out


def _typed(path: Path, key: str, value: Any, kind: type) -> Any:
    # TOML's booleans are ints to Python: a number setting takes no boolean, nor the reverse.
    if kind in (str, Path):
        ok = isinstance(value, str)
    elif kind is bool:
        ok = isinstance(value, bool)
    elif kind is list:
        ok = isinstance(value, list) and all(isinstance(entry, str) for entry in value)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok:
        expected = {
            str: "a string",
            Path: "a path string",
            int: "an integer",
            float: "a number",
            bool: "true or false",
            list: "a list of strings",
        }
        # The value is not repeated: a key or URL in the wrong place may be a secret.
        shown = _kind_of(value)
        if isinstance(value, list) and kind is list:
            odd = next(entry for entry in value if not isinstance(entry, str))
            shown = f"a list holding {_kind_of(odd)}"
        raise ConfigFileError(f"--config: {path}: {key} must be {expected[kind]}, not {shown}")
    if kind is Path:
        return path.parent / Path(value).expanduser()
    return kind(value)


def _kind_of(value: Any) -> str:
    return {list: "a list", dict: "a table", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )
