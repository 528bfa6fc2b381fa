"""The docs' short snippets run as written on the demo's bundle: README.md's `replay_bundle`
lines and its named-providers TOML, and docs/tables.md's DuckDB queries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollout.trace.v1.state_pb2 import RolloutTrace
from tests.agent_server.test_named_providers import load
from tests.docs import block

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("snippets") / "traces"
    subprocess.run(
        # The default word delay: the demo's last turn is interrupted mid-stream.
        [BIN / "agent-server", "demo", "--trace-root", str(root)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return root


def test_replay_bundle_from_python(traces: Path) -> None:
    [bundle] = traces.iterdir()
    code = block("replay-bundle", "python")
    assert code.count("traces/20261129T201500Z-<thread_id>") == 2
    namespace: dict[str, object] = {}
    exec(
        compile(code.replace("traces/20261129T201500Z-<thread_id>", str(bundle)), "README", "exec"),
        namespace,
    )
    trace, compact = namespace["trace"], namespace["compact"]
    assert isinstance(trace, RolloutTrace)
    assert isinstance(compact, RolloutTrace)
    assert trace.recording_complete
    assert len(trace.turns) == 4
    # The compact form names its previous call's request instead of listing it again.
    assert any(call.request_prefix_call_id for call in compact.inference_calls.values())
    assert not any(call.request_prefix_call_id for call in trace.inference_calls.values())


def test_the_named_providers_config(tmp_path: Path) -> None:
    settings = load(tmp_path, block("providers", "toml"))
    vllm, tserve = settings.providers
    assert (vllm.name, vllm.url, vllm.api, vllm.model) == (
        "vllm",
        "http://127.0.0.1:8000/v1",
        "chat",
        "smollm2-135m-instruct",
    )
    # The comment's promise: offering neither capability, it is never asked for them.
    assert (tserve.name, tserve.api, tserve.capabilities) == ("tserve", "responses", ())


def test_the_tables_queries(traces: Path, tmp_path: Path) -> None:
    duckdb = pytest.importorskip("duckdb", reason="needs duckdb (the test dependency group)")
    tables = tmp_path / "tables"
    reduced = subprocess.run(
        [BIN / "trace-reducer", "reduce-all", str(traces), "--tables", str(tables)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reduced.returncode == 0, reduced.stderr
    sql = block("queries", "sql", doc="docs/tables.md").replace("DIR/", f"{tables}/")
    statements = [part.strip() for part in sql.split(";") if part.strip()]
    assert len(statements) == 3
    tokens, failed, interrupted = (duckdb.sql(statement).fetchall() for statement in statements)
    [(model, input_tokens, output_tokens)] = tokens
    assert model == "local-echo-1"
    assert input_tokens > 0
    assert output_tokens > 0
    assert failed == []  # the demo's calls completed or were cancelled; none failed
    # The demo's last turn was interrupted mid-stream: its partial text is the discarded row.
    [(turn_id, partial_text)] = interrupted
    assert turn_id.startswith("turn_")
    assert partial_text.startswith("You said: ")
