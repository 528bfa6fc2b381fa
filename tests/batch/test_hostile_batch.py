"""reduce-all against what an attacker plants under its root: a FIFO named trace.binpb, counts
past int64, a CORRUPT bundle whose records held entities."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from rollout.trace.v1 import common_pb2
from tests.batch.conftest import age, bundles_under, reduce_all
from tests.batch.test_tables import Tables
from tests.trace_reducer.bundles import BundleBuilder, assistant_output, user_item

pytest.importorskip("duckdb", reason="the tables tests need duckdb (dev extra)")
pytest.importorskip("trace_reducer.batch._tables", reason="--tables needs pyarrow")


def test_a_fifo_named_trace_binpb_never_stops_the_batch(traces: Path, tmp_path: Path) -> None:
    # Was: reduce-all hung on the FIFO forever ("one bad bundle never stops the batch").
    planted = traces / "planted"
    planted.mkdir()
    os.mkfifo(planted / "trace.binpb")
    result = reduce_all(str(traces), "--tables", str(tmp_path / "tables"), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "trace.binpb is not a regular file" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    tables = Tables(tmp_path / "tables")
    good = len(bundles_under(traces)) - 1
    assert tables.value("SELECT count(*) FROM bundles WHERE integrity IS NOT NULL") == good
    assert tables.value(f"SELECT count(*) FROM bundles WHERE bundle_path = '{planted}'") == 1


def test_a_count_past_int64_is_null_and_the_tables_are_written(
    traces: Path, tmp_path: Path
) -> None:
    # Was: `input_tokens` 2^63 in one bundle: OverflowError, and no table at all.
    builder = BundleBuilder(traces / "huge", "thread-huge")
    question = user_item("how many tokens?")
    turn = builder.turn("turn-1", [question])
    call = builder.call(turn, "call-huge", [question])
    item = builder.added(call, "msg-huge")
    builder.delta(call, "a lot")
    builder.done(call, item, assistant_output("a lot", "msg-huge"))
    builder.call_ended(
        call,
        common_pb2.EXECUTION_STATUS_COMPLETED,
        reason="response.completed",
        usage=common_pb2.TokenUsage(input_tokens=2**63, output_tokens=5, total_tokens=2**64 - 1),
    )
    builder.turn_ended(turn, common_pb2.EXECUTION_STATUS_COMPLETED)
    huge = builder.close()
    age(huge / "trace.binpb", 3600)
    result = reduce_all(str(traces), "--tables", str(tmp_path / "tables"))
    assert result.returncode == 0, result.stdout + result.stderr
    tables = Tables(tmp_path / "tables")
    assert tables.rows(
        "SELECT input_tokens, output_tokens, total_tokens FROM inference_calls "
        "WHERE inference_call_id = 'call-huge'"
    ) == [(None, 5, None)]
    assert tables.value("SELECT count(DISTINCT bundle_path) FROM turns") == len(
        bundles_under(traces)
    )


def test_a_corrupt_bundle_counts_the_rows_it_has(traces: Path, tmp_path: Path) -> None:
    # Was: thread_count=1, turn_count=2 for a CORRUPT bundle with no row in threads or turns.
    corrupt = traces / "corrupt"
    shutil.copytree(bundles_under(traces)[0], corrupt)
    data = bytearray((corrupt / "trace.binpb").read_bytes())
    data[len(data) * 2 // 3] ^= 0x01
    (corrupt / "trace.binpb").write_bytes(bytes(data))
    age(corrupt / "trace.binpb", 3600)
    for salvage, directory in ((False, "tables"), (True, "salvaged")):
        args = [str(traces), "--tables", str(tmp_path / directory)]
        result = reduce_all(*args, *(["--salvage"] if salvage else []))
        assert re.search(r"CORRUPT", result.stdout), result.stdout
        tables = Tables(tmp_path / directory)
        for count, table in (
            ("thread_count", "threads"),
            ("turn_count", "turns"),
            ("inference_call_count", "inference_calls"),
            ("conversation_item_count", "conversation_items"),
            ("tool_call_count", "tool_calls"),
        ):
            stated = tables.value(f"SELECT {count} FROM bundles WHERE bundle_path = '{corrupt}'")
            rows = tables.value(f"SELECT count(*) FROM {table} WHERE bundle_path = '{corrupt}'")
            assert stated == rows, (salvage, count)
        if salvage:
            assert tables.value(f"SELECT turn_count FROM bundles WHERE bundle_path = '{corrupt}'")
