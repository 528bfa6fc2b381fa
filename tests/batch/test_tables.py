"""`reduce-all --tables`: Parquet tables of real bundles, asked real questions with DuckDB."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from agent_server import AgentServer, Settings
from rollout_client import AgentClient
from tests.batch.conftest import LOOKUP, TRACE_REDUCER, Corpus, age, bundles_under, reduce_all
from trace_reducer import replay_bundle

duckdb = pytest.importorskip(
    "duckdb", reason="the tables tests need duckdb (the test dependency group)"
)
tables_module = pytest.importorskip(
    "trace_reducer.batch._tables", reason="--tables needs pyarrow (the batch extra)"
)
SCHEMAS = tables_module.SCHEMAS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "tables.md"


class Tables:
    """A DuckDB connection with one view per table of a --tables directory."""

    def __init__(self, directory: Path) -> None:
        self.db = duckdb.connect()
        for name in SCHEMAS:
            self.db.execute(
                f"CREATE VIEW {name} AS SELECT * FROM read_parquet("
                f"'{directory}/{name}/**/*.parquet', hive_partitioning = true)"
            )

    def rows(self, sql: str) -> list[tuple[object, ...]]:
        return list(self.db.execute(sql).fetchall())

    def value(self, sql: str) -> object:
        rows = self.rows(sql)
        assert len(rows) == 1, rows
        return rows[0][0]


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


@pytest.fixture
def reduced(traces: Path, tmp_path: Path) -> Tables:
    result = reduce_all(str(traces), "--tables", str(tmp_path / "tables"))
    assert result.returncode == 0, result.stdout + result.stderr
    return Tables(tmp_path / "tables")


def test_tokens_per_model(reduced: Tables, corpus: Corpus) -> None:
    # The scripted models' usage is what the script sent (the local model's is its own).
    scripted = "model IN ('model-a', 'model-b', 'model-c')"
    rows = reduced.rows(
        "SELECT model, sum(input_tokens), sum(output_tokens) FROM inference_calls "
        f"WHERE {scripted} GROUP BY model ORDER BY model"
    )
    assert rows == [(model, *corpus.tokens[model]) for model in sorted(corpus.tokens)]
    # The thread and turn totals agree with their calls.
    for table in ("threads", "turns"):
        totals = reduced.rows(
            f"SELECT sum(input_tokens), sum(output_tokens) FROM {table} "
            f"WHERE trace_id IN (SELECT trace_id FROM inference_calls WHERE {scripted})"
        )
        assert totals == [tuple(map(sum, zip(*corpus.tokens.values(), strict=True)))], table


def test_failed_calls_per_provider_error_code(reduced: Tables, corpus: Corpus) -> None:
    rows = reduced.rows(
        "SELECT error_code, count(*) FROM inference_calls WHERE status = 'FAILED' "
        "GROUP BY error_code"
    )
    assert Counter({str(code): count for code, count in rows}) == corpus.failed_codes
    # Each failed call failed its turn, with the same code.
    assert reduced.rows(
        "SELECT count(*) FROM inference_calls c JOIN turns t USING (trace_id, turn_id) "
        "WHERE c.status = 'FAILED' AND (t.status <> 'FAILED' OR t.error_code <> c.error_code)"
    ) == [(0,)]


def test_interrupted_turns_with_their_discarded_text(reduced: Tables, corpus: Corpus) -> None:
    rows = reduced.rows(
        "SELECT t.turn_id, t.status, string_agg(d.partial_text, '' ORDER BY d.position) "
        "FROM turns t JOIN discarded_outputs d USING (trace_id, turn_id) "
        "WHERE t.interrupted GROUP BY t.turn_id, t.status"
    )
    assert {turn: text for turn, _, text in rows} == corpus.discarded
    assert {status for _, status, _ in rows} == {"CANCELLED"}


def test_tool_calls_with_their_arguments_and_outputs(reduced: Tables, corpus: Corpus) -> None:
    rows = reduced.rows(
        "SELECT name, arguments, output, status, is_error FROM tool_calls ORDER BY started_at"
    )
    assert [row[:3] for row in rows] == corpus.tool_calls
    assert {row[3:] for row in rows} == {("COMPLETED", False)}
    # call item -> tool call -> output item, and the call that asked for it.
    assert reduced.rows(
        "SELECT count(*) FROM tool_calls t "
        "JOIN conversation_items c ON c.trace_id = t.trace_id AND c.item_id = t.call_item_id "
        "JOIN conversation_items o ON o.trace_id = t.trace_id AND o.item_id = t.output_item_id "
        "JOIN inference_calls i ON i.trace_id = t.trace_id "
        "AND i.inference_call_id = t.requested_by_inference_call_id "
        "JOIN turns u ON u.trace_id = t.trace_id "
        "AND list_contains(u.tool_call_ids, t.tool_call_id) "
        "WHERE c.kind = 'FUNCTION_CALL' AND o.kind = 'FUNCTION_CALL_OUTPUT' "
        "AND o.producer_kind = 'tool' AND o.producer_id = t.tool_call_id"
    ) == [(len(corpus.tool_calls),)]


def test_foreign_keys_resolve_and_counts_match_the_states(reduced: Tables, traces: Path) -> None:
    orphans = {
        "turn without its thread": "SELECT * FROM turns ANTI JOIN threads "
        "USING (trace_id, thread_id)",
        "call without its turn": "SELECT * FROM inference_calls ANTI JOIN turns "
        "USING (trace_id, turn_id)",
        "request item not in conversation_items": "SELECT * FROM (SELECT trace_id, "
        "unnest(request_item_ids) AS item_id FROM inference_calls) ANTI JOIN "
        "conversation_items USING (trace_id, item_id)",
        "item from an unknown call": "SELECT * FROM conversation_items i WHERE "
        "producer_kind = 'inference' AND NOT EXISTS (SELECT 1 FROM inference_calls c WHERE "
        "c.trace_id = i.trace_id AND c.inference_call_id = i.producer_id)",
        "discarded output of an unknown call": "SELECT * FROM discarded_outputs ANTI JOIN "
        "inference_calls USING (trace_id, inference_call_id)",
        "entity without its bundle": "SELECT * FROM threads ANTI JOIN bundles "
        "USING (bundle_path, trace_id)",
        "reward without its thread": "SELECT * FROM rewards ANTI JOIN threads "
        "USING (bundle_path, thread_id)",
    }
    for what, sql in orphans.items():
        assert reduced.rows(sql) == [], what

    states = [replay_bundle(b) for b in bundles_under(traces)]
    expected = {
        "bundles": len(states),
        "threads": sum(len(s.threads) for s in states),
        "turns": sum(len(s.turns) for s in states),
        "inference_calls": sum(len(s.inference_calls) for s in states),
        "conversation_items": sum(len(s.conversation_items) for s in states),
        "tool_calls": sum(len(s.tool_calls) for s in states),
        "discarded_outputs": sum(
            len(c.discarded_outputs) for s in states for c in s.inference_calls.values()
        ),
        "rewards": sum(len(s.rewards) for s in states),
    }
    counted = {name: reduced.value(f"SELECT count(*) FROM {name}") for name in SCHEMAS}
    assert counted == expected
    # Every table can be read, with its documented columns.
    for name, schema in SCHEMAS.items():
        columns = [row[0] for row in reduced.rows(f"DESCRIBE {name}")]
        assert columns == [*schema.names, "day"], name


def test_partitioned_by_the_day_each_bundle_started(reduced: Tables) -> None:
    assert reduced.rows("SELECT count(*) FROM bundles WHERE day <> CAST(started_at AS DATE)") == [
        (0,)
    ]
    assert reduced.rows(
        "SELECT count(*) FROM conversation_items i JOIN bundles b USING (bundle_path) "
        "WHERE i.day <> b.day"
    ) == [(0,)]


def test_tables_from_state_json_are_identical_to_fresh_ones(traces: Path, tmp_path: Path) -> None:
    first = reduce_all(str(traces), "--tables", str(tmp_path / "first"))
    assert first.returncode == 0
    # The second run reduces nothing: its rows come from the state.json files written above.
    second = reduce_all(str(traces), "--tables", str(tmp_path / "second"))
    assert second.returncode == 0
    assert f"up to date {len(bundles_under(traces))}" in second.stdout
    assert _file_bytes(tmp_path / "first") == _file_bytes(tmp_path / "second")

    # Rewriting the same directory replaces its tables (nothing appended, no staging left).
    again = reduce_all(str(traces), "--tables", str(tmp_path / "first"))
    assert again.returncode == 0
    assert _file_bytes(tmp_path / "first") == _file_bytes(tmp_path / "second")


def test_corrupt_bundles_are_listed_and_their_entities_kept_only_when_salvaged(
    traces: Path, tmp_path: Path
) -> None:
    source = bundles_under(traces)[0]
    corrupt = traces / "corrupt"
    shutil.copytree(source, corrupt)
    data = bytearray((corrupt / "trace.binpb").read_bytes())
    data[len(data) // 2] ^= 0x01
    (corrupt / "trace.binpb").write_bytes(bytes(data))
    age(corrupt / "trace.binpb", 3600)

    result = reduce_all(str(traces), "--tables", str(tmp_path / "tables"))
    assert result.returncode == 1
    tables = Tables(tmp_path / "tables")
    offset = re.search(r"CORRUPT at byte (\d+)", result.stdout)
    assert offset is not None
    assert tables.rows(
        f"SELECT integrity, bad_frame_offset FROM bundles WHERE bundle_path = '{corrupt}'"
    ) == [("CORRUPT", int(offset.group(1)))]
    assert tables.value(f"SELECT count(*) FROM turns WHERE bundle_path = '{corrupt}'") == 0

    salvaged = reduce_all(str(traces), "--salvage", "--tables", str(tmp_path / "salvaged"))
    assert salvaged.returncode == 0
    tables = Tables(tmp_path / "salvaged")
    assert tables.rows(
        f"SELECT DISTINCT integrity FROM threads WHERE bundle_path = '{corrupt}'"
    ) == [("CORRUPT",)]


def test_every_column_is_documented() -> None:
    text = DOCS.read_text()
    sections = dict(re.findall(r"^## `(\w+)`\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    assert set(sections) == set(SCHEMAS)
    for name, schema in SCHEMAS.items():
        documented = re.findall(r"^\| `(\w+)` \|", sections[name], re.M)
        assert documented == schema.names, name


def test_the_demo_s_trace_root(tmp_path: Path) -> None:
    """`agent-server demo` (its built-in local model), then reduce-all on its trace root."""
    agent_server = str(Path(TRACE_REDUCER).parent / "agent-server")
    demo = subprocess.run(
        [agent_server, "demo", "--trace-root", str(tmp_path / "traces")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")},
    )
    assert demo.returncode == 0, demo.stderr
    # The demo wrote its own state.json already: reduce-all finds it up to date.
    result = reduce_all(str(tmp_path / "traces"), "--tables", str(tmp_path / "tables"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reduce-all: 1 bundle under" in result.stdout
    assert "up to date 1" in result.stdout
    tables = Tables(tmp_path / "tables")
    # The demo: a plain turn, a tool round trip, a turn interrupted while awaiting a tool
    # output, and one interrupted mid-stream.
    assert tables.rows("SELECT status, interrupted FROM turns ORDER BY turn_index") == [
        ("COMPLETED", False),
        ("COMPLETED", False),
        ("CANCELLED", True),
        ("CANCELLED", True),
    ]
    text = tables.value(
        "SELECT d.partial_text FROM discarded_outputs d JOIN turns t USING (trace_id, turn_id) "
        "WHERE t.interrupted"
    )
    assert isinstance(text, str)
    assert text.startswith("You said:")


async def _fork_group(root: Path) -> int:
    """A thread with a tool round trip, forked into 3 that each make one too (the GRPO shape:
    one trace, four bundles, the same item ids in each); how many tool calls were made."""
    settings = Settings(
        listen="127.0.0.1:0", provider_url=None, trace_root=root, local_word_delay=0.0
    )
    server = await AgentServer.start(settings)
    try:
        async with AgentClient(server.address) as client:
            parent = await client.start_thread(tools=[LOOKUP])
            answer = {"lookup": lambda arguments: "42"}
            await parent.run_turn("please lookup the question", tools=answer).wait()
            forks = await parent.fork(3, group_id="q1")
            for fork in forks:
                await fork.run_turn("please lookup the answer", tools=answer).wait()
            for thread in [parent, *forks]:
                await thread.close()
    finally:
        await server.stop()
    return 1 + len(forks)


def test_the_documented_item_key_is_unique_across_a_fork_group(tmp_path: Path) -> None:
    # Was: the docs said to join conversation items on (trace_id, item_id), but a fork shares
    # its parent's trace id and numbers its items from item-1 as well: over 1,728 rollouts in
    # 8-fork groups the tool_calls -> conversation_items join gave 9,408 rows for 1,344 calls.
    text = DOCS.read_text()
    key = re.search(r"\| `item_id` \| string \| .*?join on `\((\w+), item_id\)`", text)
    assert key is not None
    column = key.group(1)
    tool_calls = asyncio.run(_fork_group(tmp_path / "traces"))
    result = reduce_all(str(tmp_path / "traces"), "--tables", str(tmp_path / "tables"))
    assert result.returncode == 0, result.stdout + result.stderr
    tables = Tables(tmp_path / "tables")
    assert tables.value("SELECT count(DISTINCT trace_id) FROM bundles") == 1
    assert tables.value("SELECT count(*) FROM tool_calls") == tool_calls
    assert (
        tables.value(
            f"SELECT count(*) - count(DISTINCT ({column}, item_id)) FROM conversation_items"
        )
        == 0
    )
    assert (
        tables.value(
            "SELECT count(*) FROM tool_calls t JOIN conversation_items c "
            f"ON c.{column} = t.{column} AND c.item_id = t.call_item_id"
        )
        == tool_calls
    )


async def _rewarded_group(root: Path) -> None:
    """A parent forked into a group of 3, each fork scored twice (one weighted), and a thread
    that is no fork, scored once."""
    settings = Settings(
        listen="127.0.0.1:0", provider_url=None, trace_root=root, local_word_delay=0.0
    )
    server = await AgentServer.start(settings)
    try:
        async with AgentClient(server.address) as client:
            parent = await client.start_thread()
            await parent.run_turn("the question").wait()
            forks = await parent.fork(3, group_id="q1")
            for index, fork in enumerate(forks):
                await fork.run_turn("your answer?").wait()
                await fork.record_reward("correct", float(index % 2), source="rule")
                await fork.record_reward("format", 0.5, weight=0.5, metadata={"judge": "j1"})
            alone = await client.start_thread()
            await alone.run_turn("hello").wait()
            await alone.record_reward("correct", 1.0)
            for thread in [parent, *forks, alone]:
                await thread.close()
    finally:
        await server.stop()


def test_threads_carry_the_group_and_reward_export_rl_gives_their_samples(
    tmp_path: Path,
) -> None:
    # Was: no table held a reward, a group or a fork parent; a user joined the tables to
    # rewards by hand (from export-rl's samples or the rewards.binpb files).
    traces = tmp_path / "traces"
    asyncio.run(_rewarded_group(traces))
    result = reduce_all(str(traces), "--tables", str(tmp_path / "tables"))
    assert result.returncode == 0, result.stdout + result.stderr
    exported = subprocess.run(
        [TRACE_REDUCER, "export-rl", str(traces), "--format", "jsonl", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert exported.returncode == 0, exported.stderr
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 5
    tables = Tables(tmp_path / "tables")

    threads: dict[object, tuple[Any, ...]] = {
        row[0]: row[1:]
        for row in tables.rows(
            "SELECT thread_id, group_id, repetition_index, reward, parent_thread_id FROM threads"
        )
    }
    assert {thread: row[:3] for thread, row in threads.items()} == {
        s["thread_id"]: (s["group_id"], s["repetition_index"], s["reward"]) for s in samples
    }
    forks = [s for s in samples if s["group_id"] == "q1"]
    [parent] = [s["thread_id"] for s in samples if s["group_id"] != "q1" and not s["rewards"]]
    assert {threads[s["thread_id"]][3] for s in forks} == {parent}
    assert sorted(threads[s["thread_id"]][2] for s in forks) == [1 / 6, 1 / 6, 5 / 6]
    assert threads[parent][2] is None
    assert [row[3] for row in threads.values() if row[0] != "q1"] == [None, None]

    rewards: list[tuple[Any, ...]] = tables.rows(
        "SELECT r.thread_id, r.name, r.value, r.weight, r.source, r.metadata, r.target_found "
        "FROM rewards r JOIN threads t USING (bundle_path, thread_id) ORDER BY r.thread_id, r.seq"
    )
    assert rewards == sorted(
        (
            s["thread_id"],
            r["name"],
            r["value"],
            r["weight"],
            r["source"] or None,
            r["metadata"],
            r["found"],
        )
        for s in samples
        for r in s["rewards"]
    )
    counts = {
        row[0]: row[1] for row in tables.rows("SELECT root_thread_id, reward_count FROM bundles")
    }
    assert counts == {s["thread_id"]: len(s["rewards"]) for s in samples}


def test_a_store_that_fails_part_way_through_the_swap_keeps_the_staged_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: the store refusing the second table's move left the first table new, the second
    # gone, the rest old, and abort() removed the staged files: the new tables lost, and the
    # warning said only the store's error. Now they are kept, and the warning says where.
    import errno

    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from tests.trace_reducer.bundles import one_turn_bundle
    from trace_reducer import cli
    from trace_reducer.batch._rows import TABLES

    scheme = "movefailstables"
    refusing = {"on": False}

    class MoveFailsOnTheSecondTable(MemoryFileSystem):  # type: ignore[misc]
        """memory://, under its own protocol, refusing to move the second table's files."""

        protocol = (scheme,)

        @classmethod
        def _strip_protocol(cls, path: Any) -> Any:
            return super()._strip_protocol(str(path).removeprefix(f"{scheme}://"))

        def mv(self, path1: Any, path2: Any, **kwargs: Any) -> Any:
            if refusing["on"] and f"/{TABLES[1]}/" in str(path1):
                raise OSError(errno.EIO, "the store refused the move")
            return super().mv(path1, path2, **kwargs)

    fsspec.register_implementation(scheme, MoveFailsOnTheSecondTable, clobber=True)
    root = tmp_path / "root"
    for number in range(2):
        one_turn_bundle(root / f"run{number}")
    url = f"{scheme}://swap-fails"
    store = MoveFailsOnTheSecondTable()

    def files() -> dict[str, list[str]]:
        return {
            table: sorted(store.find(f"/swap-fails/{table}"))
            for table in TABLES
            if store.exists(f"/swap-fails/{table}")
        }

    try:
        assert cli.main(["reduce-all", str(root), "--jobs", "1", "--tables", url]) == 0
        before = files()
        assert sorted(before) == sorted(TABLES)
        capsys.readouterr()
        refusing["on"] = True
        code = cli.main(["reduce-all", str(root), "--jobs", "1", "--force", "--tables", url])
        err = capsys.readouterr().err
        [staging] = [name for name in store.ls("/swap-fails", detail=False) if ".staging-" in name]
        kept = {table: store.find(f"{staging}/{table}") for table in TABLES}
        after = {table: store.find(f"/swap-fails/{table}") for table in TABLES}
    finally:
        store.rm("/swap-fails", recursive=True)
    assert code == 1, err
    assert "Traceback" not in err
    # The first table new, the second's old files removed, the rest still old; and every
    # table not yet moved in is still staged, where the warning says.
    assert after[TABLES[0]]
    assert not kept[TABLES[0]]
    assert not after[TABLES[1]]
    assert all(after[table] == before[table] for table in TABLES[2:])
    assert all(kept[table] for table in TABLES[1:]), kept
    said = (
        f"trace-reducer: warning: cannot write the tables to {url}: the store refused the move; "
        f"the swap stopped part-way: {TABLES[0]} replaced, {TABLES[1]} part-way (its old files "
        f"removed), {', '.join(TABLES[2:])} not yet; the new files not yet moved in are kept in "
        f"{url}/{staging.rsplit('/', 1)[1]}"
    )
    assert said in err.splitlines(), err
