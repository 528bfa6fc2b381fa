"""The `trace-reducer reduce-all` command: flags, engine choice, tables, summary, exit code."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Any

from ..batch._batch import BatchOptions, BundleResult, Outcome, drive, plan, reduce_chunk
from ..batch._listing import indexed_integrity
from ..batch._report import Tally, summary
from ..batch._storage import Store, is_url, open_store, parse_storage_options
from ..bundle._confine import stops_held
from ..bundle._discover import no_bundles_there
from ..bundle._errors import BundleError, MissingExtraError, os_error_reason
from ..bundle._liveness import LIVE_WINDOW
from ..bundle._shown import one_line
from ..reduce._pool import Engine, InlineEngine, PoolEngine
from ._common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    add_storage_option_argument,
    check_output_dir,
    job_count,
    path_argument,
    redact,
    root_failure,
    seconds_argument,
    warn,
)
from ._progress import Progress, progress_for


class _Listener:
    """The batch driver's results as progress."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress

    def started(self, total: int) -> None:
        self._progress.started(total)

    def advanced(self, results: list[BundleResult]) -> None:
        bad = sum(r.outcome in (Outcome.CORRUPT, Outcome.FAILED) for r in results)
        self._progress.advanced(len(results), bad)

    def tick(self) -> None:
        self._progress.tick()

    def finished(self) -> None:
        self._progress.finished()


def add_parser(commands: Any) -> None:
    """Register reduce-all on the trace-reducer command's subparsers."""
    parser = commands.add_parser(
        "reduce-all",
        help="reduce every bundle under a directory or URL, optionally into Parquet tables",
        description=(
            "Find every bundle (a directory holding trace.binpb) under ROOT, reduce each to its "
            "state.json in parallel, and print a summary. Exit 1 when a bundle is corrupt "
            "(unless --salvage) or could not be reduced; 2 for bad input (no bundles under ROOT, "
            "an unreadable URL, a --tables directory that cannot be written, the extra --tables "
            "or --ray needs not installed)."
        ),
    )
    parser.add_argument(
        "root",
        type=path_argument,
        help="a directory, or an fsspec URL (s3://bucket/prefix, ...)",
    )
    parser.add_argument(
        "--jobs",
        type=job_count,
        metavar="N",
        help="worker processes (default: the CPU count; with --ray: the cluster's CPUs)",
    )
    parser.add_argument(
        "--force", action="store_true", help="reduce bundles whose state.json is up to date too"
    )
    parser.add_argument(
        "--salvage", action="store_true", help="reduce corrupt bundles up to the damage"
    )
    parser.add_argument(
        "--tables",
        type=path_argument,
        metavar="DIR",
        help="write Parquet tables here (a directory or URL)",
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="run on Ray: bare starts a local Ray; 'auto' or HOST:PORT joins a cluster",
    )
    parser.add_argument(
        "--live-window",
        type=seconds_argument,
        default=LIVE_WINDOW,
        metavar="SECONDS",
        help="an unfinished bundle is live, not damaged, while its writer holds it open or "
        f"while it was modified this recently (default {LIVE_WINDOW:g})",
    )
    add_storage_option_argument(parser, "URL roots and tables")
    parser.set_defaults(run=run)


def _missing_extra(error: ImportError) -> MissingExtraError:
    return MissingExtraError("reduce-all", "batch", error.name)


def _store_failure(error: Exception) -> str:
    """Why the tables could not be written, in the store's words (or the error's name, for the
    NotImplementedError of a store that cannot write, fsspec's HTTP one)."""
    if isinstance(error, OSError):
        return os_error_reason(error)
    return str(error) or type(error).__name__


def _engine(args: argparse.Namespace, store: Store) -> Engine:
    if store.process_local:
        return InlineEngine(reduce_chunk)
    if args.ray is None:
        return PoolEngine(args.jobs or os.cpu_count() or 1, reduce_chunk)
    from ..batch._ray import RayEngine  # an optional extra
    from ..bundle._errors import RayUnavailableError

    try:
        return RayEngine(args.ray, args.jobs)
    except (RayUnavailableError, BundleError):  # already one line naming --ray's address
        raise
    except Exception as error:  # Ray's own errors, as one line
        where = "a local Ray" if args.ray == "local" else f"Ray at {args.ray}"
        raise BundleError(f"cannot start or join {where}: {error}") from error


def run(args: argparse.Namespace) -> int:
    try:
        storage_options = parse_storage_options(args.storage_option)
    except ValueError as error:
        raise BundleError(str(error)) from error
    if args.tables is not None and not is_url(args.tables):
        # Before any work: the tables are written after the whole batch was reduced.
        check_output_dir("--tables", args.tables)
    options = BatchOptions(
        root=args.root,
        storage_options=storage_options,
        force=args.force,
        salvage=args.salvage,
        tables=args.tables is not None,
        live_window=args.live_window,
    )
    try:
        store = open_store(options.root, storage_options)
    except (ImportError, ValueError) as error:
        raise root_failure("reduce-all", args.root, error, "open") from error
    if store.process_local and args.ray is not None:
        raise BundleError(f"--ray cannot reach {args.root}: it exists in this process only")
    try:
        entries = store.discover(warn)
    except BundleError:
        raise
    except Exception as error:
        raise root_failure("reduce-all", args.root, error, "list") from error
    root = store.display(store.root) if is_url(options.root) else store.root
    if not entries:
        raise BundleError(no_bundles_there(root))
    tasks, known = plan(entries, options, indexed_integrity(store, options.root))

    sink = None
    if args.tables is not None:
        try:
            from ..batch._tables import TableSink  # pyarrow: an optional extra
        except ImportError as error:
            raise _missing_extra(error) from error
        try:
            sink = TableSink(args.tables, dict(storage_options))
        except (ImportError, ValueError) as error:
            # Before any work, as for the root: fsspec (or gcsfs, ...) missing, a protocol
            # fsspec does not know.
            raise root_failure("reduce-all", args.tables, error, "open") from error

    engine = _engine(args, store) if tasks else None
    tally = Tally(salvage=options.salvage)
    tally.add_known(known)

    interrupted = False
    table_rows = None
    table_error = ""

    def emit(result: BundleResult) -> None:
        nonlocal table_error
        tally.add(result)
        if sink is not None and result.rows is not None and not table_error:
            try:
                sink.add(result.day, result.rows)
            except Exception as error:  # noqa: BLE001 - a store's own (botocore's): the batch goes on
                table_error = _store_failure(error)
            result.rows = None

    started = time.perf_counter()
    try:
        if engine is not None:
            progress = _Listener(progress_for("reduce-all", lines_into_pipes=True))
            drive(engine, tasks, options, progress, emit)
        if sink is not None and not table_error:
            try:
                sink.stage()
                # A Ctrl-C or SIGTERM in the swap took effect between a table removed and its
                # new files moved in: the staged files were then removed too, the tables left
                # half old, half gone. Held, it stops the command once they are all new.
                with stops_held():
                    table_rows = sink.swap()
            except Exception as error:  # noqa: BLE001 - an OSError, or a store's own (botocore's)
                table_error = _store_failure(error)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if sink is not None and table_rows is None:
            # The store that refused the tables may refuse their clean-up as well.
            with contextlib.suppress(Exception):
                sink.abort()
    seconds = time.perf_counter() - started
    if isinstance(engine, PoolEngine) and engine.restarts:
        warn(engine.restarts_said())
    lines = summary(
        tally,
        root=root,
        found=len(entries),
        seconds=seconds,
        engine=engine.name if engine is not None else "nothing to reduce",
        slots=engine.slots if engine is not None else 0,
        tables=args.tables,
        table_rows=table_rows,
        interrupted=interrupted,
    )
    # Each line one line, whatever a bundle's name holds.
    print(redact("\n".join(map(one_line, lines))), flush=True)
    # A swap the store stopped part-way: where the new files not yet moved in are kept.
    stopped = sink.stopped_swap() if sink is not None and table_rows is None else ""
    if interrupted:
        if stopped:
            warn(f"the tables at {args.tables} are not all new: {stopped}")
        return EXIT_INTERRUPTED
    if table_error:
        said = "; ".join(filter(None, [table_error, stopped]))
        warn(f"cannot write the tables to {args.tables}: {said}")
        return EXIT_FAILED
    return EXIT_FAILED if tally.failing else EXIT_OK
