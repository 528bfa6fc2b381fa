"""The docs' short snippets run as written: README.md's `replay_bundle` lines and its
named-providers TOML, docs/tables.md's DuckDB queries (on the demo's bundle), and
docs/clients.md's TypeScript example."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.trace.v1.state_pb2 import RolloutTrace
from tests.agent_server.test_named_providers import load
from tests.docs import REPO, block
from tests.live_server import live_server
from trace_reducer import replay_bundle

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
    assert len(statements) == 4
    tokens, failed, groups, interrupted = (
        duckdb.sql(statement).fetchall() for statement in statements
    )
    [(model, input_tokens, output_tokens)] = tokens
    assert model == "local-echo-1"
    assert input_tokens > 0
    assert output_tokens > 0
    assert failed == []  # the demo's calls completed or were cancelled; none failed
    # The demo's one thread is no fork, nor scored: a group of one, its own id, no reward.
    [(group, size, reward)] = groups
    assert group.startswith("thread_")
    assert (size, reward) == (1, None)
    # The demo's last turn is interrupted mid-stream (unless a very busy machine let the reply
    # end first): the text it had streamed is what the query finds, as the state says.
    [bundle] = traces.iterdir()
    trace = replay_bundle(bundle)
    cut = {turn.turn_id for turn in trace.turns.values() if turn.HasField("interrupt")}
    expected = [
        (call.turn_id, discarded.partial_text)
        for call in trace.inference_calls.values()
        if call.turn_id in cut
        for discarded in call.discarded_outputs
    ]
    assert sorted(interrupted) == sorted(expected)
    assert all(text.startswith("You said: ") for _, text in interrupted)


def test_the_typescript_example(tmp_path: Path) -> None:
    """docs/clients.md's TypeScript example, its types stripped, on the client `make test-ts`
    built (make test builds it before pytest runs)."""
    index = REPO / "clients" / "typescript" / "dist" / "src" / "index.js"
    if not index.is_file() or not shutil.which("node"):
        pytest.skip("needs node and the built TypeScript client: make test-ts")
    source = block("typescript", "ts", doc="docs/clients.md")
    assert 'from "@rollout-trace/client"' in source
    assert 'connectAgent("127.0.0.1:50051")' in source
    traces = tmp_path / "traces"
    with live_server("--trace-root", str(traces), "--local-word-delay", "0") as served:
        script = tmp_path / "example.mjs"
        script.write_text(
            re.sub(r"(\w)!\.", r"\1.", source)  # `thread!.id`: the only TypeScript syntax in it
            .replace('"@rollout-trace/client"', json.dumps(index.as_uri()))
            .replace('"127.0.0.1:50051"', json.dumps(served.address))
        )
        ran = subprocess.run(
            ["node", str(script)], capture_output=True, text=True, timeout=120, check=False
        )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith('You said: "Hello".')
    assert ran.stdout.endswith("THREAD_NOT_FOUND\n")
    # The thread was closed: its bundle has its footer.
    [bundle] = traces.iterdir()
    assert replay_bundle(bundle).recording_complete
