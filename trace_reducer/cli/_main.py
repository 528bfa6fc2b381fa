"""The `trace-reducer` command: reduce, dump, view, watch or diff bundles; serve gRPC."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import select
import stat
import sys
import urllib.parse
import webbrowser
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from google.protobuf import json_format, text_format

from grpc_common import (
    add_access_arguments,
    add_event_loop_argument,
    announce,
    default_event_loop,
    event_loop_problem,
    listen_error,
    parse_command_line,
    run_on_loop,
)
from rollout.trace.v1 import record_pb2, state_pb2

from ..bundle._discover import holds_bundles, no_bundles_there, walk_bundles
from ..bundle._errors import (
    BundleError,
    CorruptBundleError,
    MissingExtraError,
    RecordOutOfRangeError,
    ReductionError,
    describe_os_error,
)
from ..bundle._framing import DEFAULT_MAX_UPLOAD_BYTES
from ..bundle._integrity import describe_integrity, integrity_name, require_reducible
from ..bundle._layout import REWARDS_FILE_NAME, STATE_FILE_NAME, TRACE_FILE_NAME
from ..bundle._reader import read_bundle, resolve_trace_file
from ..bundle._version import __version__
from ..reduce._replay import replay_bundle
from ..reduce._requests import request_body
from ..reduce._state_json import iter_state_json, write_state_json
from ._batch import add_parser as add_reduce_all_parser
from ._common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    check_output_dir,
    check_parents,
    hide_secrets,
    local_path_argument,
    say,
    unwritable_place,
    warn,
)
from ._diff import add_parser as add_diff_parser
from ._list import add_parser as add_list_parser
from ._progress import progress_for
from ._stdout import StdoutError, guarded_stdout, silence_stdout
from ._training import add_parsers as add_training_parsers

if TYPE_CHECKING:
    from grpc_common import AccessControl

    from ..export._otel import ExportedBundle

DEFAULT_LISTEN = "127.0.0.1:50052"
DEFAULT_VIEW_LISTEN = "127.0.0.1:8765"
_PREVIEW_CHARS = 60
_FIELDS_CHARS = 240


class _CommandError(Exception):
    """Ends the command with one line on stderr and an exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _output_file(
    given: str | None, default: Path, *, instead: str = "", inputs: Sequence[Path] = ()
) -> Path:
    """Where `-o` asks a file to be written, or `default` without it.

    The file is written beside its target and renamed over it, so what the name holds is
    replaced, not written through: a name that is not a regular file (a symlink such as
    /dev/stdout, a FIFO, a device, a directory) is refused rather than swapped for a file,
    and so is a recording (see _is_a_recording): the output would be all that was left of it.
    """
    if given is None:
        return default
    if not given:
        raise _CommandError("-o: the path is empty", EXIT_USAGE)
    target = Path(given)
    try:
        found = target.lstat()
    except FileNotFoundError:
        problem = unwritable_place(target, directory=False)
        if problem is not None:
            raise _CommandError(f"-o {given}: {problem}", EXIT_USAGE) from None
        return target
    except OSError as error:
        raise _CommandError(f"-o {given}: {describe_os_error(error)}", EXIT_USAGE) from error
    if not stat.S_ISREG(found.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(found.st_mode) else "not a regular file"
        raise _CommandError(
            f"-o {given}: {kind}; the output replaces the file named, so give a new path or "
            f"a regular file{instead}",
            EXIT_USAGE,
        )
    if _is_a_recording(target, found, inputs):
        raise _CommandError(
            f"-o {given}: a bundle's recording, which the output would replace; give "
            f"another path{instead}",
            EXIT_USAGE,
        )
    # The file there is replaced by one written beside it: its directory must take a new file
    # (/proc/version's did not: exit 1 after the work).
    problem = unwritable_place(target, directory=False)
    if problem is not None:
        raise _CommandError(f"-o {given}: {problem}", EXIT_USAGE)
    return target


def _is_a_recording(target: Path, found: os.stat_result, inputs: Sequence[Path]) -> bool:
    """Whether target is a trace or rewards file: by its name, or by being (under any name,
    a hard link included) one of the inputs' trace files or the rewards beside them."""
    if target.name in (TRACE_FILE_NAME, REWARDS_FILE_NAME):
        return True
    for trace_file in inputs:
        for record in (trace_file, trace_file.parent / REWARDS_FILE_NAME):
            try:
                kept = record.stat()
            except OSError:
                continue  # no rewards yet: nothing there to lose
            if (kept.st_dev, kept.st_ino) == (found.st_dev, found.st_ino):
                return True
    return False


# -- reduce -----------------------------------------------------------------------------------


def _warn_incomplete(integrity: state_pb2.Integrity, bundle: str, *, showing: bool) -> None:
    """The one line on stderr `reduce` and `view` give for a state that is not the whole
    rollout (the exit code stays 0): a bundle damaged or unfinished (CORRUPT and salvaged,
    UNCLOSED, TRUNCATED), or a fork whose parent's part was not found."""
    status = integrity.status
    records = integrity.records_read
    if status == state_pb2.INTEGRITY_STATUS_CLEAN:
        if integrity.fork_unresolved:
            # The detail names the parent, what of it is missing and how to give it.
            say(f"warning: unresolved fork {bundle}: {integrity.detail}")
        return
    if showing:
        done = f"showing the {records} records before it"
    elif status == state_pb2.INTEGRITY_STATUS_CORRUPT:
        done = f"salvaged {records} records before it"
    else:
        done = f"reduced {records} records"
    say(f"warning: {integrity_name(status).lower()} bundle {bundle}: {integrity.detail}; {done}")


def _reduce(args: argparse.Namespace) -> int:
    trace_file = resolve_trace_file(args.bundle)
    check_parents(args.parent)
    # Held compact either way: the complete form is written a call at a time from it.
    trace = replay_bundle(trace_file, parents=args.parent, compact=True)
    expand = not args.compact
    integrity = trace.integrity
    try:
        require_reducible(integrity, salvage=args.salvage, source=args.bundle)
    except CorruptBundleError as error:
        # The reader's detail names the byte offset and the seq of the bad frame.
        raise _CommandError(
            f"{error} (--salvage reduces the records before it)", EXIT_FAILED
        ) from error
    _warn_incomplete(integrity, args.bundle, showing=False)
    if args.stdout:
        for piece in iter_state_json(trace, expand=expand):
            sys.stdout.write(piece)
        sys.stdout.flush()
        return EXIT_OK
    target = _output_file(
        args.output,
        trace_file.parent / STATE_FILE_NAME,
        instead=" (--stdout writes to stdout)",
        inputs=[trace_file],
    )
    # Inside the bundle, private as its own files; elsewhere (-o), as any new file.
    print(write_state_json(trace, target, expand=expand, private=not args.output), flush=True)
    return EXIT_OK


# -- dump -------------------------------------------------------------------------------------


def _abbreviate(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


def _describe(record: record_pb2.TraceRecord, body: str | None) -> str:
    if body is None:
        return "(unknown body)"
    if body == "payload":
        payload = record.payload
        preview = _abbreviate(payload.data.decode("utf-8", "replace"), _PREVIEW_CHARS)
        chunk = (
            f" chunk {payload.chunk_index + 1}/{payload.chunk_count}"
            if payload.chunk_count > 1
            else ""
        )
        names = record_pb2.PayloadKind.DESCRIPTOR.values_by_number
        # A kind from a newer writer has no name here: its number says what there is.
        known = names.get(payload.kind)
        kind = known.name.removeprefix("PAYLOAD_KIND_") if known else str(payload.kind)
        return (
            f"{payload.payload_id} {kind} {payload.media_type!r} {len(payload.data)} bytes"
            f"{chunk} {json.dumps(preview, ensure_ascii=False)}"
        )
    fields = text_format.MessageToString(getattr(record, body), as_one_line=True, as_utf8=True)
    return _abbreviate(fields, _FIELDS_CHARS)


def _dump(args: argparse.Namespace) -> int:
    out = sys.stdout
    with read_bundle(args.bundle) as reader:
        for record in reader:
            body = record.WhichOneof("body")
            if args.json:
                line = json.dumps(
                    json_format.MessageToDict(record, preserving_proto_field_name=True),
                    ensure_ascii=False,
                    sort_keys=True,
                )
            else:
                seconds = record.time_us / 1_000_000
                line = (
                    f"{record.seq:>7} {seconds:>12.6f}s {body or '?':<19} {_describe(record, body)}"
                )
            out.write(line + "\n")
        integrity = reader.integrity
    out.flush()
    require_reducible(integrity, salvage=True, source=args.bundle)
    print(f"integrity: {describe_integrity(integrity)}", file=sys.stderr, flush=True)
    return EXIT_OK


# -- request ----------------------------------------------------------------------------------


def _request(args: argparse.Namespace) -> int:
    body = request_body(args.bundle, args.inference_call_id)
    if args.pretty:
        text = json.dumps(json.loads(body), indent=2, ensure_ascii=False) + "\n"
        # A lone surrogate cannot be UTF-8; its backslash form is the JSON escape it came as.
        sys.stdout.buffer.write(text.encode("utf-8", "backslashreplace"))
    else:
        sys.stdout.buffer.write(body + b"\n")
    sys.stdout.flush()
    return EXIT_OK


# -- export-otlp ------------------------------------------------------------------------------


def _export_otlp(args: argparse.Namespace) -> int:
    try:
        # The OpenTelemetry SDK is an optional extra; the other commands never import it.
        from ..bundle._errors import ExportConfigError, ExportFailedError
        from ..export._otel import export_otlp
    except ImportError as error:
        raise MissingExtraError("export-otlp", "otel", error.name) from error
    # The exporters log each retry and failure; the one line below says what matters.
    logging.getLogger("opentelemetry").addHandler(logging.NullHandler())
    reducing = progress_for("export-otlp: reducing", quiet=args.quiet)

    def sent(one: ExportedBundle) -> None:
        reducing.finished()  # every bundle is reduced before the first is sent
        _exported(one)

    try:
        export_otlp(
            args.bundles,
            endpoint=args.endpoint,
            protocol=args.protocol,
            headers=args.header,
            include_content=args.include_content,
            salvage=args.salvage,
            timeout=args.timeout,
            progress=sent,
            started=reducing.started,
            reduced=reducing.advanced,
        )
    except CorruptBundleError as error:
        raise _CommandError(
            f"{error} (--salvage exports the records before it)", EXIT_FAILED
        ) from error
    except ExportConfigError as error:
        raise _CommandError(str(error), EXIT_USAGE) from error
    except ExportFailedError as error:
        raise _CommandError(str(error), EXIT_FAILED) from error
    finally:
        reducing.finished()
    return EXIT_OK


def _exported(one: ExportedBundle) -> None:
    """One line as each bundle goes out: a long export shows its progress, and a failure
    later on leaves the lines of the bundles that were sent."""
    if one.integrity != "CLEAN":
        say(f"warning: {one.integrity.lower()} bundle {one.bundle}: exported what it holds")
    print(f"exported {one.spans} spans of {one.bundle} as trace {one.trace_id}", flush=True)


# -- view -------------------------------------------------------------------------------------


def _view(args: argparse.Namespace) -> int:
    from ..view._view import VIEW_FILE_NAME, reduce_for_view, save_view

    source = Path(args.bundle)
    if source.is_dir() and not (source / TRACE_FILE_NAME).exists() and not args.diff:
        if not holds_bundles(source):
            raise BundleError(no_bundles_there(source))
        return _view_root(args)
    for flag, value in (("--listen", args.listen), ("--token-env", args.token_env)):
        if value is not None:
            # Said, not ignored: a page written where a server was asked for misleads.
            raise _CommandError(
                f"{flag} serves a root of bundles; {args.bundle} is one bundle, whose page "
                "is written to a file (-o names it)",
                EXIT_USAGE,
            )
    if args.diff:
        return _view_diff(args)
    trace_file = resolve_trace_file(args.bundle)
    data = reduce_for_view(trace_file)
    integrity = data.trace.integrity
    require_reducible(integrity, salvage=True, source=args.bundle)
    _warn_incomplete(integrity, args.bundle, showing=True)
    target = _output_file(args.output, trace_file.parent / VIEW_FILE_NAME, inputs=[trace_file])
    # Inside the bundle, private as its own files; elsewhere (-o), as any new file.
    path = save_view(
        data,
        target,
        title=f"rollout {trace_file.parent.name}",
        mode=0o666 if args.output else 0o600,
    )
    print(path, flush=True)
    if args.open and not webbrowser.open(path.resolve().as_uri()):
        say(f"no browser could be started; open {path} yourself")
    return EXIT_OK


def _view_diff(args: argparse.Namespace) -> int:
    """`view A --diff B`: the page of the two runs compared."""
    from ..view._diff_page import DIFF_FILE_NAME, write_diff

    trace_file = resolve_trace_file(args.bundle)
    other = resolve_trace_file(args.diff)
    target = _output_file(
        args.output, trace_file.parent / DIFF_FILE_NAME, inputs=[trace_file, other]
    )
    # Inside the bundle, private as its own files; elsewhere, as any new file.
    path = write_diff(args.bundle, args.diff, target, mode=0o666 if args.output else 0o600)
    print(path, flush=True)
    if args.open and not webbrowser.open(path.resolve().as_uri()):
        say(f"no browser could be started; open {path} yourself")
    return EXIT_OK


def _view_root(args: argparse.Namespace) -> int:
    """A directory of bundles: a static site with -o, else the served viewer."""
    from ..view._site import site_place_problem, write_site

    if args.output is not None:
        if not args.output:
            raise _CommandError("-o: the path is empty", EXIT_USAGE)
        if args.listen is not None:
            raise _CommandError(
                "-o writes the site to files, --listen serves it: give one of them", EXIT_USAGE
            )
        if next(walk_bundles(args.bundle, irregular=True), None) is None:
            # An empty root, which the served list watches fill in: a site of it would be empty.
            raise BundleError(no_bundles_there(args.bundle))
        check_output_dir("-o", args.output)
        problem = site_place_problem(Path(args.output))
        if problem is not None:
            raise _CommandError(f"-o {args.output}: {problem}", EXIT_USAGE)
        # A cold root of thousands is read for minutes before a page is written: a bar for
        # that too (`view: reading`), on a terminal, then the pages' (`view`).
        progress = progress_for("view", bad_word="unreadable")
        # Said once the bar is gone: a line written under it would be drawn over.
        warnings: list[str] = []
        try:
            index = write_site(
                args.bundle,
                args.output,
                warn=warnings.append,
                reading=progress_for("view: reading", bad_word="unreadable"),
                started=progress.started,
                progress=progress.advanced,
            )
        finally:
            progress.finished()
            for message in warnings:
                warn(message)
        print(index, flush=True)
        return EXIT_OK
    listen = args.listen or DEFAULT_VIEW_LISTEN
    host, _, port_text = listen.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit() or int(port_text) > 65535:
        raise _CommandError(
            f"--listen expects HOST:PORT (a port from 0 to 65535), got {listen!r}",
            EXIT_USAGE,
        )
    token: str | None = None
    from grpc_common import is_loopback

    if args.token_env:
        from grpc_common import variable_name

        try:
            variable_name(args.token_env, "--token-env")
        except ValueError as error:
            raise _CommandError(str(error), EXIT_USAGE) from None
        token = os.environ.get(args.token_env) or None
        if token is None:
            # The words of every other token flag (`--auth-token-env names …`).
            raise _CommandError(
                f"--token-env names {args.token_env}, which is unset or empty", EXIT_USAGE
            )
    elif not is_loopback(host):
        import secrets

        token = secrets.token_urlsafe(24)
    return asyncio.run(_serve_site(args.bundle, listen, token, args.open))


async def _serve_site(root: str, listen: str, token: str | None, open_page: bool) -> int:
    from grpc_common import install_signal_handlers

    from ..view._site import SiteServer

    host, _, port_text = listen.rpartition(":")
    server = SiteServer(root, token, warn=warn)
    # Before the port opens, as every server's: a signal as soon as it listens stops it cleanly.
    stop = asyncio.Event()
    install_signal_handlers(stop.set)
    try:
        address = await server.start(host.strip("[]"), int(port_text))
    except OSError as error:
        await server.stop()
        # As every server says it (was aiohttp's "error while attempting to bind on address
        # ('127.0.0.1', 8765): …", or a bare "Name or service not known", and exit 1).
        raise _CommandError(str(listen_error(listen, error)), EXIT_USAGE) from error
    # Quoted: a --token-env token holding `+`, `&`, `#` or `%` was printed as it is, and the
    # address it made did not open the viewer (401).
    shown = f"{address}?token={urllib.parse.quote(token, safe='')}" if token else address
    try:
        announce(f"serving {shown}", say, silence_stdout)
        if next(walk_bundles(root, irregular=True), None) is None:
            say(f"no bundles under {root} yet: the list shows each as it is written (Ctrl-C stops)")
        if open_page and not webbrowser.open(shown):
            say(f"no browser could be started; open {shown} yourself")
        await stop.wait()
    finally:
        await server.stop()
    return EXIT_OK


# -- watch ------------------------------------------------------------------------------------


def _watch(args: argparse.Namespace) -> int:
    from ..view._live import LiveTranscript, follow_and_print

    trace_file = resolve_trace_file(args.bundle)
    printer = LiveTranscript(sys.stdout)
    try:
        trace = asyncio.run(follow_and_print(trace_file, printer))
    except KeyboardInterrupt:
        printer.close_line()
        sys.stdout.flush()
        raise _CommandError(
            f"stopped watching {args.bundle} (interrupted) after {printer.records_read} "
            "records; the recording had not completed",
            EXIT_INTERRUPTED,
        ) from None
    # The transcript's last line (ended by the printer) goes out before any error on stderr: into
    # one pipe or file (`watch B 2>&1 | less`), the error would otherwise follow a half line.
    sys.stdout.flush()
    try:
        require_reducible(trace.integrity, salvage=False, source=args.bundle)
    except CorruptBundleError as error:
        raise _CommandError(str(error), EXIT_FAILED) from error
    integrity = trace.integrity
    if integrity.status != state_pb2.INTEGRITY_STATUS_CLEAN:
        # The watch ended with no footer: its writer went away (killed, or its recording failed).
        raise _CommandError(f"{args.bundle}: {describe_integrity(integrity)}", EXIT_FAILED)
    print(f"recording complete: {integrity.records_read} records", flush=True)
    return EXIT_OK


# -- serve ------------------------------------------------------------------------------------


async def _serve_async(
    listen: str,
    bundle_root: str,
    access: AccessControl,
    max_upload_bytes: int,
    metrics_listen: str | None = None,
) -> int:
    # gRPC's server side takes a noticeable time to import; reduce and dump do not need it.
    from prometheus_client import PROCESS_COLLECTOR, CollectorRegistry

    from grpc_common import (
        GrpcServer,
        ListenError,
        MetricsServer,
        RpcMetricsInterceptor,
        install_signal_handlers,
    )

    from ..service._service import SERVICE_NAME, ReducerService, add_to_server

    service = ReducerService(bundle_root, max_upload_bytes=max_upload_bytes)
    registry = CollectorRegistry()
    registry.register(PROCESS_COLLECTOR)
    # One request log line per RPC on stderr.
    request_log = logging.getLogger("trace_reducer.rpc")
    if not request_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        request_log.addHandler(handler)
        request_log.setLevel(logging.INFO)
        request_log.propagate = False
    rpc_metrics = RpcMetricsInterceptor(
        registry, "rollout_reducer", request_log, ok_level=logging.INFO
    )
    metrics = None
    if metrics_listen is not None:
        try:
            metrics = MetricsServer.start(metrics_listen, registry)
        except (ValueError, OSError) as error:
            # A ListenError names the address, `cannot serve metrics on HOST:PORT: …`, as the
            # agent server says it (was `--metrics-listen: cannot serve metrics on …`).
            where = "" if isinstance(error, ListenError) else "--metrics-listen: "
            raise _CommandError(f"{where}{error}", EXIT_USAGE) from error
        announce(f"metrics at {metrics.url}", say, silence_stdout)
    # Before the port opens, as every server's: a signal as soon as it listens stops it cleanly.
    stop = asyncio.Event()
    install_signal_handlers(stop.set)
    try:
        server = await GrpcServer.start(
            listen,
            lambda grpc_server: add_to_server(service, grpc_server),
            [SERVICE_NAME],
            access,
            rpc_metrics=rpc_metrics,
        )
    except (ValueError, ListenError) as error:
        if metrics is not None:
            metrics.stop()
        # A ListenError names the address: `cannot listen on HOST:PORT: address already in use`.
        where = "" if isinstance(error, ListenError) else "--listen: "
        raise _CommandError(f"{where}{error}", EXIT_USAGE) from error
    try:
        announce(f"listening on {server.address}", say, silence_stdout)
        await stop.wait()
    finally:
        # Stopped whatever ended the wait: an unstopped grpc.aio server prints a traceback
        # when it is collected after its loop closed.
        await server.stop(grace=5.0)
        if metrics is not None:
            metrics.stop()
    return EXIT_OK


def _serve(args: argparse.Namespace) -> int:
    root = args.bundle_root or os.getcwd()
    if not os.path.isdir(root):
        from grpc_common._files import path_kind

        # What it is instead: missing, a FIFO, a file, a link to nothing.
        raise _CommandError(
            f"--bundle-root is not a directory: {root} is {path_kind(root)}", EXIT_USAGE
        )
    from grpc_common import AccessControl

    try:
        access = AccessControl.load(
            token_env=args.auth_token_env, tls_cert=args.tls_cert, tls_key=args.tls_key
        )
    except ValueError as error:
        raise _CommandError(str(error), EXIT_USAGE) from error
    if args.max_upload_bytes < 1:
        raise _CommandError("--max-upload-bytes must be a positive number of bytes", EXIT_USAGE)
    event_loop = args.event_loop or default_event_loop()
    problem = event_loop_problem(event_loop)
    if problem is not None:
        raise _CommandError(problem, EXIT_USAGE)
    return run_on_loop(
        _serve_async(args.listen, root, access, args.max_upload_bytes, args.metrics_listen),
        event_loop,
    )


# -- entry point ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Replay rollout-trace bundles into their reduced state."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    reduce = commands.add_parser("reduce", help="write the reduced state of a bundle as JSON")
    reduce.add_argument(
        "bundle", type=local_path_argument, help="bundle directory or its trace.binpb"
    )
    target = reduce.add_mutually_exclusive_group()
    target.add_argument(
        "-o", "--output", metavar="PATH", help="write here, not <bundle>/state.json"
    )
    target.add_argument("--stdout", action="store_true", help="print the JSON instead")
    reduce.add_argument(
        "--salvage", action="store_true", help="reduce a corrupt bundle up to the damage"
    )
    reduce.add_argument(
        "--compact",
        action="store_true",
        help="each request as a prefix of the previous one plus its new items "
        "(InferenceCall.request_prefix_call_id/_count): linear in the conversation",
    )
    reduce.add_argument(
        "--parent",
        action="append",
        type=local_path_argument,
        default=[],
        metavar="BUNDLE",
        help="a fork's parent bundle when it is not beside the fork (repeatable)",
    )
    reduce.set_defaults(run=_reduce)

    add_reduce_all_parser(commands)
    add_list_parser(commands)

    dump = commands.add_parser("dump", help="print the records of a bundle, one per line")
    dump.add_argument(
        "bundle", type=local_path_argument, help="bundle directory or its trace.binpb"
    )
    dump.add_argument("--json", action="store_true", help="JSON lines instead of text")
    dump.set_defaults(run=_dump)

    request = commands.add_parser(
        "request", help="print the exact JSON body an inference call sent to the provider"
    )
    request.add_argument(
        "bundle", type=local_path_argument, help="bundle directory or its trace.binpb"
    )
    request.add_argument("inference_call_id", help="as in the reduced state's inference_calls")
    request.add_argument("--pretty", action="store_true", help="indent the JSON")
    request.set_defaults(run=_request)

    export = commands.add_parser(
        "export-otlp",
        help="send bundles as OpenTelemetry GenAI spans to an OTLP receiver",
        description="Exit codes: 0 sent, 1 the receiver did not take the spans, a corrupt "
        "bundle without --salvage, or records that contradict each other; 2 bad input "
        "(bundle, endpoint, protocol, header, timeout) or the otel extra not installed.",
    )
    export.add_argument(
        "bundles",
        nargs="+",
        type=local_path_argument,
        metavar="bundle",
        help="bundle directory or file",
    )
    export.add_argument(
        "--endpoint",
        metavar="URL",
        help="OTLP receiver (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as it is, else "
        "OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces for http/protobuf, else localhost:4317 for "
        "grpc, localhost:4318/v1/traces for http/protobuf)",
    )
    export.add_argument(
        "--protocol",
        choices=["grpc", "http/protobuf"],
        default=None,
        help="default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, "
        "else grpc",
    )
    export.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="send this header (repeatable; default: OTEL_EXPORTER_OTLP_TRACES_HEADERS, else "
        "OTEL_EXPORTER_OTLP_HEADERS)",
    )
    export.add_argument(
        "--include-content",
        action="store_true",
        default=None,
        help="add instructions, messages and tool arguments and results to the spans "
        "(default: OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true|span_only, else off)",
    )
    export.add_argument(
        "--salvage", action="store_true", help="export a corrupt bundle up to the damage"
    )
    export.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="per send, with retries (default: OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT, in "
        "milliseconds, else 10 s)",
    )
    export.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar on stderr (shown on a terminal only)",
    )
    export.set_defaults(run=_export_otlp)

    add_training_parsers(commands)
    add_diff_parser(commands)

    view = commands.add_parser(
        "view",
        help="a bundle's self-contained HTML page; or, for a directory of bundles, serve "
        "the run list (or write it as a static site with -o DIR)",
    )
    view.add_argument(
        "bundle",
        type=local_path_argument,
        help="bundle directory or its trace.binpb, or a root holding bundles",
    )
    view.add_argument(
        "-o",
        "--output",
        metavar="PATH",
        help="write here, not <bundle>/view.html; for a root: the site's directory",
    )
    view.add_argument("--open", action="store_true", help="open the page in a web browser")
    view.add_argument(
        "--diff",
        type=local_path_argument,
        metavar="OTHER",
        help="the page of this bundle compared with bundle OTHER call by call, as `diff` "
        "reports it (default <bundle>/diff.html)",
    )
    view.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"where a root is served (default {DEFAULT_VIEW_LISTEN}); off loopback a token "
        "is required",
    )
    view.add_argument(
        "--token-env",
        metavar="NAME",
        help="the served viewer's token from this environment variable (default: made up "
        "when not on loopback, printed in the address)",
    )
    view.set_defaults(run=_view)

    watch = commands.add_parser(
        "watch",
        help="print a bundle's transcript live as it is written, until it completes or its"
        " writer is gone",
    )
    watch.add_argument(
        "bundle", type=local_path_argument, help="bundle directory or its trace.binpb"
    )
    watch.set_defaults(run=_watch)

    serve = commands.add_parser("serve", help="run the ReducerService gRPC server")
    serve.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"gRPC address; port 0 picks a free one (default {DEFAULT_LISTEN})",
    )
    serve.add_argument(
        "--bundle-root",
        type=local_path_argument,
        metavar="DIR",
        help="bundles are read under here (cwd)",
    )
    add_access_arguments(serve)
    serve.add_argument(
        "--max-upload-bytes",
        type=int,
        default=DEFAULT_MAX_UPLOAD_BYTES,
        metavar="N",
        help="ReduceRecords refuses larger uploads with RESOURCE_EXHAUSTED "
        f"(default {DEFAULT_MAX_UPLOAD_BYTES})",
    )
    serve.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics (per-RPC counts, latencies, codes) at "
        "http://HOST:PORT/metrics",
    )
    add_event_loop_argument(serve)
    serve.set_defaults(run=_serve)
    return parser


def _stdout_gone() -> bool:
    """Whether stdout is a pipe nobody reads any more (its write end then polls as an error)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        events = poller.poll(0)
    except (OSError, ValueError):
        return True
    return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in events)


def _undecodable_name(error: UnicodeEncodeError) -> str | None:
    """The text being encoded, shown, when what failed is a byte of a file name that is not
    UTF-8 (Python holds those as lone surrogates U+DC80-U+DCFF); None for any other failure."""
    bad = error.object[error.start : error.end]
    if not bad or not all("\udc80" <= char <= "\udcff" for char in bad):
        return None
    # The text may be a whole page: the name is the word around the bad bytes.
    text, start, end = error.object, error.start, error.end
    while start > 0 and error.start - start < 120 and text[start - 1] not in _NAME_ENDS:
        start -= 1
    while end < len(text) and end - error.end < 120 and text[end] not in _NAME_ENDS:
        end += 1
    return os.fsencode(text[start:end]).decode("utf-8", "backslashreplace")


_NAME_ENDS = frozenset(" \t\n\"'<>")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; never lets a traceback out."""
    args = parse_command_line(build_parser(), argv)
    hide_secrets(
        (getattr(args, "root", None), getattr(args, "tables", None), _ray_url(args)),
        getattr(args, "storage_option", None) or (),
    )
    with guarded_stdout():
        return _run(args)


def _ray_url(args: argparse.Namespace) -> str | None:
    """`reduce-all --ray ADDRESS` as a URL whose credentials are hidden like a root's: the
    refusals quote the address (`cannot join Ray at ray://user:pw@head:10001`), and a HOST:PORT
    pasted with a user and password has no scheme to be read by."""
    address: str | None = getattr(args, "ray", None)
    if address is None or "://" in address:
        return address
    return f"ray://{address}"


def _run(args: argparse.Namespace) -> int:
    """The command, and the one place its failures become a line and an exit code."""
    try:
        code: int = args.run(args)
        # What is still buffered fails here, not after the exit code was chosen.
        sys.stdout.flush()
    except StdoutError as error:
        silence_stdout()
        if error.errno != errno.EPIPE:  # `| head`: the reader went away; nothing to say
            say(error.describe())
        return int(getattr(args, "output_failed", EXIT_FAILED))
    except _CommandError as failure:
        say(str(failure))
        return failure.code
    except (BundleError, MissingExtraError) as error:
        say(str(error))
        return EXIT_USAGE
    except RecordOutOfRangeError as error:
        say(f"record out of range: {error}")
        return EXIT_FAILED
    except ReductionError as error:
        say(f"records contradict each other: {error}")
        return EXIT_FAILED
    except BrokenPipeError as error:
        if not _stdout_gone():
            # Some other pipe (a worker process's, say): that is an error to report.
            say(describe_os_error(error))
            return EXIT_FAILED
        # The reader went away (`| head`); say nothing more to it.
        silence_stdout()
        return int(getattr(args, "output_failed", EXIT_FAILED))
    except OSError as error:
        say(describe_os_error(error))
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except UnicodeEncodeError as error:
        named = _undecodable_name(error)
        if named is None:
            say(f"internal error: {type(error).__name__}: {error}")
            return EXIT_FAILED
        say(f"a file name is not valid UTF-8, which the output cannot hold (rename it): {named}")
        return EXIT_USAGE
    except Exception as error:  # noqa: BLE001 - the edge: nothing may escape as a traceback
        say(f"internal error: {type(error).__name__}: {error}")
        return EXIT_FAILED
    return code
