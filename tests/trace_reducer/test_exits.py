"""trace_reducer/_exits.py: the one place both commands take their names and exit codes from."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.trace_reducer.conftest import TRACE_REDUCER
from trace_reducer import _exits

ROOT = Path(__file__).resolve().parents[2]
AGENT_SERVER = str(Path(sys.executable).parent / "agent-server")


def test_the_codes_are_the_documented_ones() -> None:
    # The README's: 0 done, 1 failed, 2 bad input, 130 interrupted, 143 stopped by SIGTERM.
    assert (_exits.EXIT_OK, _exits.EXIT_FAILED, _exits.EXIT_USAGE) == (0, 1, 2)
    assert (_exits.EXIT_INTERRUPTED, _exits.EXIT_TERMINATED) == (130, 143)
    assert (_exits.TRACE_REDUCER, _exits.AGENT_SERVER) == ("trace-reducer", "agent-server")


def test_no_other_module_defines_an_exit_code() -> None:
    # Was: agent_server/exits.py and trace_reducer/cli/_exits.py, two copies of the same four.
    defined = []
    for package in ("agent_server", "trace_reducer", "grpc_common"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                targets = node.targets if isinstance(node, ast.Assign) else []
                if isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                place = path.relative_to(ROOT)
                defined += [f"{place}:{name}" for name in names if name.startswith("EXIT_")]
    codes = ("EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_INTERRUPTED", "EXIT_TERMINATED")
    assert defined == [f"trace_reducer/_exits.py:{name}" for name in codes]


def test_the_entry_point_has_them_before_anything_loads() -> None:
    # cli.main answers a Ctrl-C with EXIT_INTERRUPTED while the command loads: importing it
    # must not load asyncio (grpc_common) first, where a Ctrl-C would be a traceback.
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, trace_reducer.cli; print('asyncio' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.strip() == "False"


def test_both_commands_end_a_usage_error_with_their_name_and_exit_2(tmp_path: Path) -> None:
    reducer = subprocess.run(
        [TRACE_REDUCER, "list", str(tmp_path / "missing")], capture_output=True, text=True
    )
    assert reducer.returncode == _exits.EXIT_USAGE
    assert reducer.stderr.startswith(f"{_exits.TRACE_REDUCER}: "), reducer.stderr
    agent = subprocess.run(
        [AGENT_SERVER, "serve", "--port", "99999"], capture_output=True, text=True, timeout=60
    )
    assert agent.returncode == _exits.EXIT_USAGE
    assert f"{_exits.AGENT_SERVER}" in agent.stderr.splitlines()[-1], agent.stderr
