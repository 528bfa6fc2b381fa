"""The cheap commands import only what they need (their time is measured in bench/, S1)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What a command that serves nothing must not load: the server, the reducer,
# the HTTP client of the providers. Of trace_reducer, its package (whose names load when
# first asked for) and its exit codes (a module that imports nothing) are light.
_HEAVY = ("agent_server.server", "trace_reducer.", "aiohttp", "httpx")
_LIGHT = frozenset({"trace_reducer._exits"})


def _heavy(loaded: set[str]) -> set[str]:
    return {name for name in loaded if name.startswith(_HEAVY) and name not in _LIGHT}


def _imported_by(*argv: str) -> set[str]:
    code = (
        "import json, sys\n"
        "from agent_server import cli\n"
        "try:\n"
        f"    cli.main({list(argv)!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "sys.__stdout__.write('\\n' + json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return set(json.loads(result.stdout.rsplit("\n", 1)[1]))


@pytest.mark.parametrize(
    "argv",
    [("--help",), ("--version",), ("health", "--help"), ("chat", "--help"), ("serve", "--help")],
)
def test_help_and_version_load_nothing_heavy(argv: tuple[str, ...]) -> None:
    loaded = _imported_by(*argv)
    assert not _heavy(loaded)
    if argv[0] != "serve":
        assert "grpc" not in loaded


def test_health_loads_grpc_and_nothing_else_heavy() -> None:
    # Nothing listens on port 1: the probe fails, having loaded what it needs.
    loaded = _imported_by("health", "--address", "127.0.0.1:1", "--timeout", "0.5")
    assert "grpc" in loaded
    assert not _heavy(loaded)
    # The probe's two messages are read and written by hand: no protobuf runtime.
    assert not {name for name in loaded if name.startswith("google.protobuf")}


def test_the_commands_still_parse_their_flags() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agent_server.cli", "serve", "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in result.stderr
