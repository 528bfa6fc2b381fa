"""A bundle's rewards.binpb as an attacker plants it: a symlink out of the root, a dangling
link, a FIFO; and a sidecar of many rewards, appended one at a time."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.trace.v1 import record_pb2
from trace_reducer import (
    REWARDS_FILE_NAME,
    RewardError,
    RewardInput,
    append_reward,
    encode_record,
    read_rewards,
    replay_bundle,
)

from .bundles import one_turn_bundle


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trace_reducer.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def reward(value: float = 1.0) -> RewardInput:
    return RewardInput(thread_id="thread-1", name="score", value=value)


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return one_turn_bundle(tmp_path / "root")


def test_a_symlinked_sidecar_is_never_written_through(bundle: Path, tmp_path: Path) -> None:
    # Was: RecordReward truncated the file the link points to and wrote records into it.
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    (bundle / REWARDS_FILE_NAME).symlink_to(outside)
    with pytest.raises(RewardError, match="symbolic link") as raised:
        append_reward(bundle, reward(), trace_id="t")
    assert raised.value.reason == "REWARDS_UNWRITABLE"
    assert outside.read_bytes() == b"precious"
    result = run_cli("reward", bundle, "--name", "score", "--value", "1")
    assert result.returncode == 1, result.stderr
    assert "symbolic link" in result.stderr
    assert "Traceback" not in result.stderr
    assert outside.read_bytes() == b"precious"
    # Reading does not follow it either: the state says why it has no rewards.
    trace = replay_bundle(bundle)
    assert not trace.rewards
    assert "rewards.binpb is a symbolic link" in trace.integrity.detail


def test_a_dangling_symlinked_sidecar_creates_nothing(bundle: Path, tmp_path: Path) -> None:
    # Was: the link's target was created, outside the root.
    target = tmp_path / "created-outside.binpb"
    (bundle / REWARDS_FILE_NAME).symlink_to(target)
    with pytest.raises(RewardError, match="symbolic link"):
        append_reward(bundle, reward(), trace_id="t")
    assert not target.exists()


@pytest.mark.parametrize("command", ["reduce", "reward", "export-rl"])
def test_a_fifo_sidecar_is_refused_at_once(bundle: Path, tmp_path: Path, command: str) -> None:
    # Was: reduce, reward and export-rl waited forever for a writer to open the FIFO.
    os.mkfifo(bundle / REWARDS_FILE_NAME)
    commands: dict[str, list[str | Path]] = {
        "reduce": ["reduce", bundle, "--stdout"],
        "reward": ["reward", bundle, "--name", "score", "--value", "1"],
        "export-rl": ["export-rl", bundle, "--format", "jsonl", "--out", tmp_path / "out"],
    }
    args = commands[command]
    result = run_cli(*args)
    assert "Traceback" not in result.stderr
    assert "internal error" not in result.stderr
    if command == "reward":
        assert result.returncode == 1
        assert "rewards.binpb is not a regular file" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
    assert read_rewards(bundle).problem == "rewards.binpb is not a regular file"


def test_appending_reads_only_what_was_written_since(
    bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: each append re-read the whole sidecar (0.9 s per reward at 200,000: O(N^2)).
    count = 300
    read = 0
    real_read, real_pread = os.read, os.pread

    def counted_read(fd: int, size: int) -> bytes:
        nonlocal read
        data = real_read(fd, size)
        read += len(data)
        return data

    def counted_pread(fd: int, size: int, offset: int) -> bytes:
        nonlocal read
        data = real_pread(fd, size, offset)
        read += len(data)
        return data

    monkeypatch.setattr(os, "read", counted_read)
    monkeypatch.setattr(os, "pread", counted_pread)
    for index in range(count):
        assert append_reward(bundle, reward(index), trace_id="t") == index + 2
    monkeypatch.undo()
    size = (bundle / REWARDS_FILE_NAME).stat().st_size
    # Each record is read once after it was written, plus a few bytes of the header per append
    # to tell the same file from a replaced one.
    assert read <= size + count * 64
    found = read_rewards(bundle)
    assert [r.value for _, r in found.rewards] == [float(i) for i in range(count)]
    assert found.problem == ""


def test_another_writer_and_a_replaced_sidecar_are_read_again(bundle: Path) -> None:
    # The cache of what was read never hides what another writer appended, or a new file.
    assert append_reward(bundle, reward(1), trace_id="t") == 2
    result = run_cli("reward", bundle, "--name", "score", "--value", "2")
    assert result.returncode == 0, result.stderr
    assert append_reward(bundle, reward(3), trace_id="t") == 4
    sidecar = bundle / REWARDS_FILE_NAME
    sidecar.unlink()
    assert append_reward(bundle, reward(4), trace_id="t") == 2
    sidecar.write_bytes(sidecar.read_bytes()[:-3])  # torn by a writer that died
    assert append_reward(bundle, reward(5), trace_id="t") == 2
    assert [r.value for _, r in read_rewards(bundle).rewards] == [5.0]


def test_a_file_that_is_no_sidecar_is_refused_not_cut(bundle: Path) -> None:
    # Was: `g` read as a frame of 103 bytes, the file as torn with 0 records, cut to 0 bytes
    # and a new sidecar written in its place.
    sidecar = bundle / REWARDS_FILE_NAME
    for foreign in (b"garbage\x00\xff", b"precious notes\n", b"\x01"):
        sidecar.write_bytes(foreign)
        with pytest.raises(RewardError, match="not a rewards sidecar") as raised:
            append_reward(bundle, reward(), trace_id="t")
        assert raised.value.reason == "REWARDS_CORRUPT"  # RecordReward's DATA_LOSS
        result = run_cli("reward", bundle, "--name", "score", "--value", "1")
        assert result.returncode == 1, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "not a rewards sidecar" in result.stderr
        assert sidecar.read_bytes() == foreign


def test_a_sidecar_torn_after_its_header_is_still_repaired(bundle: Path) -> None:
    assert append_reward(bundle, reward(1), trace_id="t") == 2
    sidecar = bundle / REWARDS_FILE_NAME
    header_and_one = sidecar.read_bytes()
    sidecar.write_bytes(header_and_one + b"\x40torn")  # a writer died mid-append
    assert append_reward(bundle, reward(2), trace_id="t") == 3
    assert sidecar.read_bytes().startswith(header_and_one)
    assert [r.value for _, r in read_rewards(bundle).rewards] == [1.0, 2.0]


def test_a_reward_time_past_year_9999_is_damage_not_an_internal_error(bundle: Path) -> None:
    assert append_reward(bundle, reward(1), trace_id="t") == 2
    far = record_pb2.RewardRecorded(thread_id="thread-1", name="score", value=2.0)
    far.recorded_at.seconds = 1_000_000_000_000  # year 33658: no state can show it
    sidecar = bundle / REWARDS_FILE_NAME
    with sidecar.open("ab") as out:
        out.write(encode_record(record_pb2.TraceRecord(seq=3, reward_recorded=far)))
    # Was: `reduce` exited 1, "internal error: SerializeToJsonError", and `reduce-all`
    # failed the bundle; the reward before it is kept and the state says why.
    commands: list[list[str | Path]] = [
        ["reduce", bundle],
        ["reduce-all", bundle.parent, "--force"],
    ]
    for args in commands:
        result = run_cli(*args)
        assert result.returncode == 0, (args, result.stderr)
        assert "internal error" not in result.stderr
        state = json.loads((bundle / "state.json").read_text(encoding="utf-8"))
        assert [r["value"] for r in state["rewards"]] == [1.0]
        assert "seq 3: recorded_at" in state["integrity"]["detail"]


def _reward_with_room_for(room: int, bundle: Path, name: str) -> subprocess.CompletedProcess[str]:
    """`trace-reducer reward` whose file writes fail past `room` more bytes of the sidecar
    (EFBIG, as on a full disk or past a quota)."""
    sidecar = bundle / "rewards.binpb"
    limit = (sidecar.stat().st_size if sidecar.exists() else 0) + room

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = ["reward", str(bundle), "--name", name, "--value", "1", "--metadata", "n=" + "x" * 200]
    return subprocess.run(
        [sys.executable, "-m", "trace_reducer.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        preexec_fn=small_files,
    )


@pytest.mark.parametrize("before", [0, 3])
def test_a_reward_cut_short_by_a_full_disk_leaves_no_torn_frame(
    tmp_path: Path, before: int
) -> None:
    # Was: the bytes written stayed: a torn header had every later reward refused for good
    # ("not a rewards sidecar"), a torn reward made the state say the sidecar was damaged.
    bundle = one_turn_bundle(tmp_path)
    for n in range(before):
        assert run_cli("reward", bundle, "--name", f"r{n}", "--value", "1").returncode == 0
    sidecar = bundle / "rewards.binpb"
    size = sidecar.stat().st_size if sidecar.exists() else 0
    failed = _reward_with_room_for(20, bundle, "cut")
    assert failed.returncode == 1, failed.stderr
    assert "short write" in failed.stderr or "File too large" in failed.stderr, failed.stderr
    assert sidecar.stat().st_size == size
    assert run_cli("reward", bundle, "--name", "after", "--value", "1").returncode == 0
    trace = replay_bundle(bundle)
    assert trace.integrity.detail == ""
    names = [reward.name for reward in trace.rewards]
    assert names == [*(f"r{n}" for n in range(before)), "after"]
