"""ReducerService over a real loopback channel: results, status codes, path confinement."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from grpc_common import ERROR_DOMAIN, GrpcServer
from rollout.reducer.v1 import reducer_pb2, reducer_pb2_grpc
from rollout.trace.v1 import record_pb2, state_pb2
from trace_reducer import Reducer, replay_bundle
from trace_reducer.bundle._confine import BundleRoot, ConfinedBundle
from trace_reducer.service import SERVICE_NAME, ReducerService, _service, add_to_server

from .bundles import BundleBuilder, fork_of, one_turn_bundle, user_item
from .process import read_bytes_of_process
from .test_hostile import crafted_bundles

if TYPE_CHECKING:
    from rollout.reducer.v1.reducer_pb2_grpc import ReducerServiceAsyncStub


@dataclass
class Served:
    root: Path
    channel: grpc.aio.Channel
    stub: ReducerServiceAsyncStub


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    root = tmp_path / "root"
    root.mkdir()
    reducer_service = ReducerService(root)
    server = await GrpcServer.start(
        "127.0.0.1:0", lambda s: add_to_server(reducer_service, s), [SERVICE_NAME]
    )
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield Served(root, channel, reducer_pb2_grpc.ReducerServiceStub(channel))
    finally:
        await channel.close(None)
        await server.stop(None)


async def refused(call: Any) -> tuple[grpc.StatusCode, error_details_pb2.ErrorInfo, str]:
    """Await a failing call; return its code, ErrorInfo and message."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    error = caught.value
    trailers: Any = error.trailing_metadata() or ()  # the stubs type it as one pair
    details = [value for key, value in trailers if key == "grpc-status-details-bin"]
    assert details, "no google.rpc.Status in the trailers"
    assert isinstance(details[0], bytes)
    status = status_pb2.Status.FromString(details[0])
    assert status.code == error.code().value[0]
    assert status.message == error.details()
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.domain == ERROR_DOMAIN
    return error.code(), info, status.message


def reduce_request(bundle: str, **fields: bool) -> reducer_pb2.ReduceBundleRequest:
    return reducer_pb2.ReduceBundleRequest(bundle=bundle, **fields)


async def test_reduce_bundle_matches_replay_and_writes_state(served: Served) -> None:
    bundle = one_turn_bundle(served.root)
    response = await served.stub.ReduceBundle(reduce_request(bundle.name))
    assert response.trace == replay_bundle(bundle)
    assert response.state_path == ""
    assert not (bundle / "state.json").exists()

    response = await served.stub.ReduceBundle(
        reduce_request(f"{bundle.name}/trace.binpb", write_state=True)
    )
    assert response.state_path == str(bundle.resolve() / "state.json")
    assert (bundle / "state.json").is_file()
    # An absolute path is fine as long as it stays under the root.
    response = await served.stub.ReduceBundle(reduce_request(str(bundle)))
    assert response.trace.recording_complete


async def test_paths_outside_the_root_are_refused(served: Served, tmp_path: Path) -> None:
    outside = one_turn_bundle(tmp_path / "outside")
    (served.root / "link-out").symlink_to(outside)
    inside_dir = served.root / "inside"
    inside_dir.mkdir()
    (inside_dir / "trace.binpb").symlink_to(outside / "trace.binpb")
    escapes = [
        f"../outside/{outside.name}",
        str(outside),
        "link-out",
        "inside",
        "inside/../../outside",
        "/etc",
    ]
    for bundle in escapes:
        code, info, message = await refused(served.stub.ReduceBundle(reduce_request(bundle)))
        assert code == grpc.StatusCode.PERMISSION_DENIED, bundle
        assert info.reason == "PATH_OUTSIDE_ROOT", bundle
        assert str(tmp_path) not in message.replace(bundle, "")


async def test_write_state_lands_in_the_directory_opened_even_if_swapped_for_a_symlink(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = one_turn_bundle(served.root)
    outside = tmp_path / "outside"
    outside.mkdir()
    moved = served.root / "moved"
    final_state = Reducer.final_state

    def state_then_swap(reducer: Reducer, *, compact: bool = False) -> state_pb2.RolloutTrace:
        # Between reading the bundle and writing state.json, its directory becomes a symlink
        # to a directory outside the root.
        trace = final_state(reducer, compact=compact)
        bundle.rename(moved)
        bundle.symlink_to(outside)
        return trace

    monkeypatch.setattr(Reducer, "final_state", state_then_swap)
    response = await served.stub.ReduceBundle(reduce_request(bundle.name, write_state=True))
    assert list(outside.iterdir()) == []
    assert (moved / "state.json").is_file()
    assert response.state_path == str(served.root.resolve() / bundle.name / "state.json")


async def test_symlinks_and_special_files_under_the_root_are_not_followed(served: Served) -> None:
    bundle = one_turn_bundle(served.root)
    (served.root / "alias").symlink_to(bundle.name)
    fifo_dir = served.root / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "trace.binpb")
    code, info, message = await refused(served.stub.ReduceBundle(reduce_request("alias")))
    assert (code, info.reason) == (grpc.StatusCode.PERMISSION_DENIED, "PATH_OUTSIDE_ROOT")
    assert "symbolic link" in message
    # Opening a FIFO for reading would wait for a writer: it must be refused at once.
    code, info, _ = await refused(served.stub.ReduceBundle(reduce_request("fifo"), timeout=30))
    assert (code, info.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "NOT_A_BUNDLE")
    # The root itself may be reached through a symlink; below it, nothing is followed.
    assert (await served.stub.ReduceBundle(reduce_request(str(bundle)))).trace.trace_id


@pytest.mark.parametrize(
    ("bundle", "code", "reason"),
    [
        ("", grpc.StatusCode.INVALID_ARGUMENT, "BUNDLE_PATH_INVALID"),
        ("bad\0name", grpc.StatusCode.INVALID_ARGUMENT, "BUNDLE_PATH_INVALID"),
        ("no-such-bundle", grpc.StatusCode.NOT_FOUND, "BUNDLE_NOT_FOUND"),
        ("plain-dir", grpc.StatusCode.INVALID_ARGUMENT, "NOT_A_BUNDLE"),
        ("empty", grpc.StatusCode.INVALID_ARGUMENT, "NOT_A_BUNDLE"),
        ("garbage", grpc.StatusCode.INVALID_ARGUMENT, "NOT_A_BUNDLE"),
        # Was: BUNDLE_PATH_INVALID, "names the bundle root itself", of a file beside bundles.
        ("notes.txt", grpc.StatusCode.INVALID_ARGUMENT, "NOT_A_BUNDLE"),
        ("n" * 300, grpc.StatusCode.INVALID_ARGUMENT, "BUNDLE_PATH_INVALID"),
        ("n" * 5000, grpc.StatusCode.INVALID_ARGUMENT, "BUNDLE_PATH_INVALID"),
        ("d/" * 2000, grpc.StatusCode.NOT_FOUND, "BUNDLE_NOT_FOUND"),
        ("../" * 1000, grpc.StatusCode.PERMISSION_DENIED, "PATH_OUTSIDE_ROOT"),
    ],
)
async def test_bad_bundle_arguments(
    served: Served, bundle: str, code: grpc.StatusCode, reason: str
) -> None:
    (served.root / "plain-dir").mkdir()
    (served.root / "plain-dir" / "notes.txt").write_text("not a bundle")
    (served.root / "empty").mkdir()
    (served.root / "empty" / "trace.binpb").write_bytes(b"")
    (served.root / "garbage").mkdir()
    (served.root / "garbage" / "trace.binpb").write_bytes(os.urandom(300))
    (served.root / "notes.txt").write_text("not a bundle")
    got_code, info, message = await refused(served.stub.ReduceBundle(reduce_request(bundle)))
    assert (got_code, info.reason) == (code, reason)
    assert "bundle root itself" not in message


async def _watch_into(stub: ReducerServiceAsyncStub, bundle: str, updates: list[str]) -> None:
    request = reducer_pb2.WatchBundleRequest(bundle=bundle)
    async for update in stub.WatchBundle(request):
        updates.append(str(update))


async def test_a_root_that_is_itself_a_fork_never_leads_to_its_parent_beside_it(
    tmp_path: Path,
) -> None:
    # Was: asked for ".", the service reduced the root as a bundle and looked for the fork's
    # parent beside it, outside the root, and answered with the parent's conversation.
    parent = BundleBuilder(tmp_path, "parent")
    shared = user_item("the parent's words, outside the root")
    parent.turn("turn-1", [shared])
    root = fork_of(tmp_path, parent.close(), [shared], "child")
    server = await GrpcServer.start(
        "127.0.0.1:0", lambda s: add_to_server(ReducerService(root), s), [SERVICE_NAME]
    )
    channel = grpc.aio.insecure_channel(server.address)
    stub: ReducerServiceAsyncStub = reducer_pb2_grpc.ReducerServiceStub(channel)
    try:
        for bundle in (".", "trace.binpb", str(root), f"{root}/trace.binpb", "./."):
            code, info, message = await refused(stub.ReduceBundle(reduce_request(bundle)))
            assert (code, info.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "BUNDLE_PATH_INVALID")
            assert "names the bundle root itself" in message
            updates: list[str] = []
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _watch_into(stub, bundle, updates)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert not any("outside the root" in update for update in updates)
    finally:
        await channel.close(None)
        await server.stop(None)


def corrupt(bundle: Path) -> bytes:
    """The bundle's bytes with one flipped in its last frame; also written back to it."""
    data = bytearray((bundle / "trace.binpb").read_bytes())
    data[-4] ^= 0x01
    (bundle / "trace.binpb").write_bytes(data)
    return bytes(data)


async def test_corrupt_bundle_is_data_loss_unless_salvaged(served: Served) -> None:
    bundle = one_turn_bundle(served.root)
    corrupt(bundle)
    code, info, message = await refused(served.stub.ReduceBundle(reduce_request(bundle.name)))
    assert code == grpc.StatusCode.DATA_LOSS
    assert info.reason == "BUNDLE_CORRUPT"
    expected = replay_bundle(bundle).integrity
    assert info.metadata["bad_frame_offset"] == str(expected.bad_frame_offset)
    assert info.metadata["bad_frame_seq"] == str(expected.bad_frame_seq)
    assert "CRC mismatch" in message
    response = await served.stub.ReduceBundle(reduce_request(bundle.name, salvage=True))
    assert response.trace.integrity.status == state_pb2.INTEGRITY_STATUS_CORRUPT
    assert not response.trace.recording_complete


async def test_contradicting_records_are_failed_precondition(served: Served) -> None:
    builder = BundleBuilder(served.root)
    seq = builder.append(turn_started=record_pb2.TurnStarted(turn=1, thread=3, turn_id="t"))
    bundle = builder.close()
    code, info, message = await refused(served.stub.ReduceBundle(reduce_request(bundle.name)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.reason == "RECORDS_CONTRADICT"
    assert message.startswith(f"seq {seq}: ")


async def test_unwritable_state_is_an_io_error(served: Served) -> None:
    bundle = one_turn_bundle(served.root)
    (bundle / "state.json").mkdir()
    code, info, _ = await refused(
        served.stub.ReduceBundle(reduce_request(bundle.name, write_state=True))
    )
    assert (code, info.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "IO_ERROR")


async def test_unexpected_errors_are_internal_without_details(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(path: object) -> state_pb2.RolloutTrace:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(_service, "replay_confined", explode)
    bundle = one_turn_bundle(served.root)
    code, info, message = await refused(served.stub.ReduceBundle(reduce_request(bundle.name)))
    assert (code, info.reason) == (grpc.StatusCode.INTERNAL, "INTERNAL")
    assert "secret" not in message
    assert "Traceback" not in message


def chunks(
    data: bytes, size: int, *, salvage: bool = False
) -> list[reducer_pb2.ReduceRecordsRequest]:
    pieces = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    requests = [reducer_pb2.ReduceRecordsRequest(chunk=piece) for piece in pieces]
    requests[0].salvage = salvage
    return requests


def upload(
    stub: ReducerServiceAsyncStub, requests: Iterable[reducer_pb2.ReduceRecordsRequest]
) -> Any:
    """Start a ReduceRecords call streaming requests; await it for the response."""

    async def stream() -> AsyncIterator[reducer_pb2.ReduceRecordsRequest]:
        for request in requests:
            yield request

    return stub.ReduceRecords(stream())


async def test_reduce_records_in_small_chunks_equals_replay(served: Served) -> None:
    bundle = one_turn_bundle(served.root)
    data = (bundle / "trace.binpb").read_bytes()
    for size in (1, 7, 64, len(data)):
        response = await upload(served.stub, chunks(data, size))
        assert response.trace == replay_bundle(bundle), size


async def test_reduce_records_errors(served: Served) -> None:
    bundle = one_turn_bundle(served.root)
    data = corrupt(bundle)
    code, info, _ = await refused(upload(served.stub, chunks(data, 50)))
    assert (code, info.reason) == (grpc.StatusCode.DATA_LOSS, "BUNDLE_CORRUPT")
    salvaged = await upload(served.stub, chunks(data, 50, salvage=True))
    assert salvaged.trace.integrity.status == state_pb2.INTEGRITY_STATUS_CORRUPT
    assert salvaged.trace.trace_id

    code, info, _ = await refused(upload(served.stub, []))
    assert (code, info.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "NOT_A_BUNDLE")

    builder = BundleBuilder(served.root, "thread-2")
    builder.append(turn_started=record_pb2.TurnStarted(turn=1, thread=3, turn_id="t"))
    contradicting = (builder.close() / "trace.binpb").read_bytes()
    code, info, _ = await refused(upload(served.stub, chunks(contradicting, 100)))
    assert (code, info.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "RECORDS_CONTRADICT")


async def test_requests_that_do_not_parse_are_invalid_argument(served: Served) -> None:
    garbage = b"\xff\xff\xff\xff"
    reduce_bundle = served.channel.unary_unary(
        "/rollout.reducer.v1.ReducerService/ReduceBundle",
        request_serializer=None,
        response_deserializer=None,
    )
    reduce_records = served.channel.stream_unary(
        "/rollout.reducer.v1.ReducerService/ReduceRecords",
        request_serializer=None,
        response_deserializer=None,
    )
    for call in (reduce_bundle(garbage), reduce_records(iter([garbage]))):
        code, info, message = await refused(call)
        assert (code, info.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")
        assert "does not parse" in message


async def test_health_and_reflection(served: Served) -> None:
    health = health_pb2_grpc.HealthStub(served.channel)
    answer = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert answer.status == health_pb2.HealthCheckResponse.SERVING

    reflection = reflection_pb2_grpc.ServerReflectionStub(served.channel)

    async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    names: list[str] = []
    async for reply in reflection.ServerReflectionInfo(ask()):
        names.extend(s.name for s in reply.list_services_response.service)
    assert SERVICE_NAME in names


async def test_a_2_gib_non_bundle_is_refused_without_reading_it(served: Served) -> None:
    zeros = served.root / "zeros"
    zeros.mkdir()
    with (zeros / "trace.binpb").open("wb") as sparse:
        sparse.truncate(2 * 1024 * 1024 * 1024)
    before = read_bytes_of_process()
    code, info, _ = await refused(served.stub.ReduceBundle(reduce_request("zeros")))
    assert (code, info.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "NOT_A_BUNDLE")
    assert read_bytes_of_process() - before < 8 * 1024 * 1024


async def test_an_upload_is_answered_at_its_first_bad_frame(served: Served) -> None:
    data = corrupt(one_turn_bundle(served.root))
    sent_everything = asyncio.Event()

    def stream(salvage: bool) -> AsyncIterator[reducer_pb2.ReduceRecordsRequest]:
        async def requests() -> AsyncIterator[reducer_pb2.ReduceRecordsRequest]:
            yield reducer_pb2.ReduceRecordsRequest(chunk=data, salvage=salvage)
            # The client keeps the stream open: nothing after the damage may be waited for.
            await sent_everything.wait()

        return requests()

    call = served.stub.ReduceRecords(stream(salvage=False), timeout=30)
    code, info, _ = await refused(call)
    assert (code, info.reason) == (grpc.StatusCode.DATA_LOSS, "BUNDLE_CORRUPT")
    answer = await served.stub.ReduceRecords(stream(salvage=True), timeout=30)
    assert answer.trace.integrity.status == state_pb2.INTEGRITY_STATUS_CORRUPT
    assert answer.trace.trace_id


async def test_an_upload_over_the_limit_is_resource_exhausted(tmp_path: Path) -> None:
    root = tmp_path / "root"
    small = (one_turn_bundle(root / "small", text="x") / "trace.binpb").read_bytes()
    large = (one_turn_bundle(root / "large", text="word " * 100) / "trace.binpb").read_bytes()
    limit = len(small)
    limited = ReducerService(root, max_upload_bytes=limit)
    server = await GrpcServer.start(
        "127.0.0.1:0", lambda s: add_to_server(limited, s), [SERVICE_NAME]
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = reducer_pb2_grpc.ReducerServiceStub(channel)
            code, info, message = await refused(upload(stub, chunks(large, 300)))
            assert (code, info.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "UPLOAD_TOO_LARGE")
            assert info.metadata["limit_bytes"] == str(limit)
            assert f"{limit}-byte limit" in message
            answer = await upload(stub, chunks(small, 300))
            assert answer.trace.recording_complete
    finally:
        await server.stop(None)


async def test_crafted_bundles_are_handled_never_internal(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    bundles = crafted_bundles(served.root)
    with caplog.at_level(logging.WARNING):
        for name in ("deep", "surrogate"):
            request = reduce_request(str(bundles[name]), write_state=True)
            answer = await served.stub.ReduceBundle(request)
            assert answer.trace.recording_complete, name
            assert answer.state_path == str(bundles[name] / "state.json")
        request = reduce_request(str(bundles["year-33658"]), write_state=True)
        code, info, message = await refused(served.stub.ReduceBundle(request))
        assert (code, info.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "RECORD_OUT_OF_RANGE")
        assert message.startswith("seq 1: ")
        data = (bundles["year-33658"] / "trace.binpb").read_bytes()
        code, info, _ = await refused(upload(served.stub, chunks(data, 10)))
        assert info.reason == "RECORD_OUT_OF_RANGE"
    assert caplog.records == []


@pytest.mark.parametrize("rpc", ["ReduceBundle", "WatchBundle"])
async def test_a_forks_parent_is_never_read_through_a_directory_swapped_for_a_symlink(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rpc: str
) -> None:
    # Was: the parent was looked for under the path of the fork's directory, resolved again
    # when the fork turned out to be one: a directory under the root swapped for a symlink
    # in between led the service to a bundle outside the root, whose words it answered with.
    outside = tmp_path / "outside"
    parent = BundleBuilder(outside, "parent")
    secret = user_item("the parent's words, outside the root")
    parent.turn("turn-1", [secret])
    sub = served.root / "sub"
    child = fork_of(sub, parent.close(), [secret], "child")
    open_bundle = BundleRoot.open

    def open_then_swap(confined: BundleRoot, bundle: str) -> ConfinedBundle:
        # Once the fork is open, and before its parent is looked for.
        opened = open_bundle(confined, bundle)
        if not sub.is_symlink():
            sub.rename(served.root / "moved")
            sub.symlink_to(outside)
        return opened

    monkeypatch.setattr(BundleRoot, "open", open_then_swap)
    if rpc == "ReduceBundle":
        answer = await served.stub.ReduceBundle(reduce_request(f"sub/{child.name}"))
        states = [str(answer.trace)]
    else:
        states = []
        await _watch_into(served.stub, f"sub/{child.name}", states)
    assert sub.is_symlink()
    assert states
    assert not any("outside the root" in state for state in states)


async def test_a_forks_parent_beside_it_in_a_subdirectory_is_found(served: Served) -> None:
    sub = served.root / "sub"
    parent = BundleBuilder(sub, "parent")
    shared = user_item("the parent's words, beside the fork")
    parent.turn("turn-1", [shared])
    child = fork_of(sub, parent.close(), [shared], "child")
    for bundle in (f"sub/{child.name}", str(child)):
        answer = await served.stub.ReduceBundle(reduce_request(bundle))
        assert "beside the fork" in str(answer.trace)
        states: list[str] = []
        await _watch_into(served.stub, bundle, states)
        assert "beside the fork" in states[-1]
