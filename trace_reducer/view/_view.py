"""`trace-reducer view`: one self-contained HTML page that shows what happened in a bundle."""

from __future__ import annotations

import base64
import functools
import hashlib
import html
import json
import os
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO

from google.protobuf import timestamp_pb2

from rollout.trace.v1 import common_pb2, state_pb2

from ..bundle._confine import write_aside
from ..bundle._errors import NotABundleError, PayloadError
from ..bundle._names import KIND_WORDS, ROLE_WORDS, execution_word, integrity_word
from ..bundle._payloads import PayloadStore, canonical_json, payload_json
from ..bundle._reader import BundleReader, read_bundle, resolve_trace_file
from ..bundle._rewards import read_rewards
from ..reduce._forks import BundleForkResolver
from ..reduce._parents import ParentBundle
from ..reduce._pass import keeping_payloads, reduce_reader
from ._run_page import RunLinks, rollout_extras

VIEW_FILE_NAME = "view.html"

# Turns per page of the transcript and the timeline; the page builds only what it shows.
PAGE_TURNS = 25

# Flow entries of a turn that share a seq: inputs a request brought, the call, what it dropped,
# then an interrupt.
_ITEM, _CALL, _DISCARDED, _INTERRUPT = 0, 1, 2, 3
_NEVER = 1 << 62
_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")


@dataclass(frozen=True)
class ViewData:
    """A bundle reduced, plus the payloads that rebuild each request body on demand."""

    trace: state_pb2.RolloutTrace
    payloads: PayloadStore
    # A fork's parent: the payloads of the history the fork shares.
    parent: ParentBundle | None = None

    def payload(self, pid: str) -> bytes:
        """A payload of the bundle or of the bundles it forked from; PayloadError if none."""
        try:
            return self.payloads.get(pid)
        except PayloadError:
            data = self.parent.payload(pid) if self.parent is not None else None
            if data is None:
                raise
            return data


def reduce_for_view(path: str | os.PathLike[str]) -> ViewData:
    """Reduce a bundle of any integrity (up to its damage) in one pass, keeping its payloads."""
    with read_bundle(path) as reader:
        return reduce_reader_for_view(reader)


def reduce_reader_for_view(
    reader: BundleReader, *, dir_fd: int | None = None, forks: BundleForkResolver | None = None
) -> ViewData:
    """reduce_for_view on a bundle already open (its rewards read through dir_fd if given, a
    fork's parent found by `forks` if given, else beside it by path)."""
    # Every kind: payloads are deduplicated by content, so an input item may be the bytes an
    # output item was first written as.
    payloads = PayloadStore(budget=None)
    reduced = reduce_reader(
        reader,
        forks=forks or BundleForkResolver(reader.bundle_dir, every_payload=True),
        rewards=read_rewards(reader.bundle_dir, dir_fd=dir_fd),
        on_record=keeping_payloads(payloads),
    )
    return ViewData(reduced.trace, payloads, reduced.parent)


def _ms(stamp: timestamp_pb2.Timestamp, base: timestamp_pb2.Timestamp) -> float | None:
    if stamp.seconds == 0 and stamp.nanos == 0:
        return None
    return round((stamp.seconds - base.seconds) * 1000 + (stamp.nanos - base.nanos) / 1e6, 3)


def _error(error: common_pb2.TraceError) -> dict[str, Any] | None:
    if not (error.code or error.message or error.http_status):
        return None
    return {"code": error.code, "message": error.message, "http": error.http_status}


def _delta(current: Sequence[str], previous: Sequence[str]) -> tuple[int, list[str]]:
    """How current extends previous: the length of their common prefix, then what follows."""
    keep = len(previous)
    if keep > len(current) or list(current[:keep]) != list(previous):
        keep = 0
        for mine, theirs in zip(current, previous, strict=False):
            if mine != theirs:
                break
            keep += 1
    return keep, list(current[keep:])


class _PageBuilder:
    """Turns the reduced state into the page's data: small, and in the order it is shown."""

    def __init__(self, data: ViewData) -> None:
        self.trace = data.trace
        self.store = data
        self.base = data.trace.started_at
        self.envelopes: dict[str, list[str] | None] = {}
        self.inputs: dict[str, str | None] = {}

    def time(self, stamp: timestamp_pb2.Timestamp) -> float | None:
        return _ms(stamp, self.base)

    def execution(self, execution: state_pb2.Execution) -> dict[str, Any]:
        return {
            "status": execution_word(execution.status),
            "start": self.time(execution.started_at),
            "end": self.time(execution.ended_at),
            "start_seq": execution.started_seq,
            "end_seq": execution.ended_seq,
        }

    def threads(self) -> list[state_pb2.Thread]:
        root = self.trace.root_thread_id
        return sorted(self.trace.threads.values(), key=lambda t: (t.thread_id != root, t.thread_id))

    def build(self) -> tuple[dict[str, Any], dict[str, Any]]:
        trace = self.trace
        integrity = trace.integrity
        page: dict[str, Any] = {
            "trace": {
                "trace_id": trace.trace_id,
                "root_thread_id": trace.root_thread_id,
                "producer": f"{trace.producer_name} {trace.producer_version}".strip(),
                "started_at": _iso(trace.started_at),
                "ended_at": _iso(trace.ended_at),
                "duration": self.time(trace.ended_at),
                "recording_complete": trace.recording_complete,
                "integrity": {
                    "status": integrity_word(integrity.status),
                    "detail": integrity.detail,
                    "records_read": integrity.records_read,
                    "bytes_read": integrity.bytes_read,
                    "bad_frame_offset": integrity.bad_frame_offset,
                    "bad_frame_seq": integrity.bad_frame_seq,
                    "unknown_records": integrity.unknown_records,
                },
            },
            "page_turns": PAGE_TURNS,
            "threads": [],
            "turns": {},
            "calls": {},
            "items": {},
            "tools": {},
        }
        order: dict[str, int] = {}
        for thread in self.threads():
            for item_id in thread.conversation_item_ids:
                order.setdefault(item_id, len(order))
            page["threads"].append(self.thread(thread))
        for item_id, item in trace.conversation_items.items():
            page["items"][item_id] = self.item(item)
        for tool_id, tool in trace.tool_calls.items():
            page["tools"][tool_id] = self.tool(tool)
        by_turn: dict[str, list[state_pb2.ConversationItem]] = {}
        for item in trace.conversation_items.values():
            by_turn.setdefault(item.turn_id, []).append(item)
        for thread in self.threads():
            previous: state_pb2.InferenceCall | None = None
            for turn_id in thread.turn_ids:
                turn = trace.turns[turn_id]
                calls = [trace.inference_calls[c] for c in turn.inference_call_ids]
                page["turns"][turn_id] = self.turn(turn, calls, by_turn.get(turn_id, []), order)
                for call in calls:
                    page["calls"][call.inference_call_id] = self.call(call, previous)
                    previous = call
        payloads = {
            "envelopes": self.envelopes,
            "inputs": self.inputs,
        }
        return page, payloads

    def thread(self, thread: state_pb2.Thread) -> dict[str, Any]:
        instructions = ""
        if thread.instructions_payload_id:
            try:
                instructions = self.store.payload(thread.instructions_payload_id).decode(
                    "utf-8", "replace"
                )
            except PayloadError:
                instructions = ""
        entry = {
            "id": thread.thread_id,
            "model": thread.model,
            **self.execution(thread.execution),
            "metadata": dict(sorted(thread.metadata.items())),
            "instructions": instructions,
            "turns": list(thread.turn_ids),
            "item_count": len(thread.conversation_item_ids),
        }
        last = self.trace.turns.get(thread.turn_ids[-1]) if thread.turn_ids else None
        if last is not None and thread.execution.status != common_pb2.EXECUTION_STATUS_RUNNING:
            # A person reads the badge as how the thread went: the outcome of its last turn,
            # not that its recording was closed cleanly (docs/vocabulary.md).
            entry["status"] = execution_word(last.execution.status)
        return entry

    def item(self, item: state_pb2.ConversationItem) -> dict[str, Any]:
        producers: list[list[str]] = []
        for ref in item.produced_by:
            which = ref.WhichOneof("producer")
            if which == "inference":
                producers.append(["inference", ref.inference.inference_call_id])
            elif which == "user_input":
                producers.append(["user_input", ref.user_input.turn_id])
            elif which == "tool":
                producers.append(["tool", ref.tool.tool_call_id])
        entry: dict[str, Any] = {
            "id": item.item_id,
            "thread": item.thread_id,
            "turn": item.turn_id,
            "role": ROLE_WORDS.get(item.role, "unspecified"),
            "kind": KIND_WORDS.get(item.kind, "unspecified"),
            "parts": [[part.type, part.text] for part in item.content],
            "rid": item.responses_item_id,
            "by": producers,
            "seq": item.first_seen_seq,
            "at": self.time(item.first_seen_at),
        }
        for field in ("call_id", "name", "arguments", "output"):
            value = getattr(item, field)
            if value:
                entry[field] = value
        return entry

    def tool(self, tool: state_pb2.ToolCall) -> dict[str, Any]:
        return {
            "id": tool.tool_call_id,
            "call_id": tool.call_id,
            "name": tool.name,
            "turn": tool.turn_id,
            "requested_by": tool.requested_by_inference_call_id,
            "call_item": tool.call_item_id,
            "output_item": tool.output_item_id,
            **self.execution(tool.execution),
            "is_error": tool.is_error,
            "submitted_by": tool.submitted_by,
        }

    def turn(
        self,
        turn: state_pb2.Turn,
        calls: list[state_pb2.InferenceCall],
        items: Iterable[state_pb2.ConversationItem],
        order: dict[str, int],
    ) -> dict[str, Any]:
        flow: list[tuple[int, int, int, list[Any]]] = []
        for item in items:
            position = order.get(item.item_id, _NEVER)
            flow.append((item.first_seen_seq, _ITEM, position, ["i", item.item_id]))
        for call in calls:
            call_id = call.inference_call_id
            flow.append((call.execution.started_seq, _CALL, 0, ["c", call_id]))
            end = call.execution.ended_seq or _NEVER
            for index in range(len(call.discarded_outputs)):
                flow.append((end, _DISCARDED, index, ["d", call_id, index]))
        interrupt = None
        if turn.HasField("interrupt"):
            interrupt = {
                "by": turn.interrupt.requested_by,
                "at": self.time(turn.interrupt.requested_at),
                "seq": turn.interrupt.seq,
            }
            flow.append((turn.interrupt.seq, _INTERRUPT, 0, ["x"]))
        flow.sort(key=lambda entry: entry[:3])
        return {
            "id": turn.turn_id,
            "thread": turn.thread_id,
            **self.execution(turn.execution),
            "calls": list(turn.inference_call_ids),
            "tools": list(turn.tool_call_ids),
            "inputs": list(turn.input_item_ids),
            "interrupt": interrupt,
            "error": _error(turn.error),
            "flow": [entry[3] for entry in flow],
        }

    def call(
        self, call: state_pb2.InferenceCall, previous: state_pb2.InferenceCall | None
    ) -> dict[str, Any]:
        # A call's input repeats the one before it and adds a little: each list is stored as
        # that difference, so a 1,000-call thread costs O(calls), not O(calls²).
        base = previous.inference_call_id if previous is not None else None
        keep, added = _delta(call.request_item_ids, previous.request_item_ids if previous else ())
        input_keep, input_added = _delta(
            call.input_payload_ids, previous.input_payload_ids if previous else ()
        )
        usage = call.usage
        return {
            "id": call.inference_call_id,
            "thread": call.thread_id,
            "turn": call.turn_id,
            "attempt": call.attempt,
            **self.execution(call.execution),
            "model": call.model,
            "provider": call.provider_base_url,
            "response_id": call.response_id,
            "end_reason": call.end_reason,
            "usage": {
                "input": usage.input_tokens,
                "output": usage.output_tokens,
                "total": usage.total_tokens,
                "cached": usage.cached_input_tokens,
                "reasoning": usage.reasoning_tokens,
            }
            if call.HasField("usage")
            else None,
            "error": _error(call.error),
            "accepted": list(call.response_item_ids),
            "discarded": [
                {"id": out.provider_item_id, "type": out.item_type, "text": out.partial_text}
                for out in call.discarded_outputs
            ],
            "seen": {"base": base, "keep": keep, "add": added},
            "seen_count": len(call.request_item_ids),
            "body": self.body(call, base, input_keep, input_added),
        }

    def body(
        self, call: state_pb2.InferenceCall, base: str | None, keep: int, added: list[str]
    ) -> dict[str, Any]:
        # Each payload is prepared once for the page, however many calls send it again.
        for pid in added:
            self._input(pid)
        envelope = call.request_envelope_payload_id
        if envelope:
            self._envelope(envelope)
        return {"envelope": envelope, "base": base, "keep": keep, "add": added}

    def _input(self, pid: str) -> None:
        if pid not in self.inputs:
            try:
                self.inputs[pid] = canonical_json(payload_json(self.store.payload(pid))).decode()
            except (PayloadError, ValueError):
                self.inputs[pid] = None  # the page says the body cannot be rebuilt

    def _envelope(self, pid: str) -> list[str] | None:
        """The envelope's JSON cut where `input` goes: the body is prefix, inputs, suffix."""
        if pid not in self.envelopes:
            self.envelopes[pid] = None
            try:
                request = payload_json(self.store.payload(pid))
            except (PayloadError, ValueError):
                return None
            if not isinstance(request, dict):
                return None
            marker = f"input-goes-here-{uuid.uuid4().hex}"
            request["input"] = marker
            text = canonical_json(request).decode()
            prefix, found, suffix = text.partition(json.dumps(marker))
            if found and marker not in suffix:
                self.envelopes[pid] = [prefix, suffix]
        return self.envelopes[pid]


def _iso(stamp: timestamp_pb2.Timestamp) -> str:
    if stamp.seconds == 0 and stamp.nanos == 0:
        return ""
    return stamp.ToJsonString()


def _script_json(value: object) -> str:
    # Inside <script> only `</script` or `<!--` could end the data early; no `<` survives.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")


# The helpers every page's script shares, inlined into each page ahead of its own.
PAGE_SCRIPT = "_page.js"


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def script_hash(script: str) -> str:
    """The CSP source that lets exactly this inline script run."""
    return f"'sha256-{base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()}'"


@dataclass(frozen=True)
class SharedAssets:
    """A static site's style and scripts, written once into its own directory and named by
    every run page, where a page of its own inlines them (~47 KB a page: most of a site of
    thousands of runs).

    The pages load the scripts through one inline loader, the only script their policy names
    by hash, with 'strict-dynamic' passing its trust to the scripts it inserts: a script tag
    that ever slipped into a page as markup stays refused, as with the inline scripts."""

    style: str
    loader: str

    @property
    def loader_hash(self) -> str:
        return script_hash(self.loader)


# Each page's style and scripts, in the order the page runs them.
_STYLE = "_view.css"
_SCRIPTS = (PAGE_SCRIPT, "_view.js", "_run.js")


def _write_all(data: bytes, out: BinaryIO) -> None:
    out.write(data)


def write_assets(directory: str | os.PathLike[str], href: str) -> SharedAssets:
    """Write the run pages' style and scripts into directory, each named by its content (a
    site written again by a newer version never pairs a page with another version's script);
    href is how a page reaches the directory (`../assets/`)."""
    names: dict[str, str] = {}
    for asset in (_STYLE, *_SCRIPTS):
        text = _asset(asset).encode("utf-8")
        stem, _, suffix = asset.lstrip("_").partition(".")
        name = f"{stem}-{hashlib.sha256(text).hexdigest()[:16]}.{suffix}"
        write_aside(Path(directory) / name, functools.partial(_write_all, text))
        names[asset] = href + name
    sources = json.dumps([names[script] for script in _SCRIPTS])
    loader = (
        '"use strict";\n'
        "// The site's shared scripts, run in order once the page's data is in place.\n"
        f"for (const source of {sources}) {{\n"
        '  const script = document.createElement("script");\n'
        "  script.src = source;\n"
        "  script.async = false;\n"
        "  document.body.appendChild(script);\n"
        "}\n"
    )
    return SharedAssets(style=names[_STYLE], loader=loader)


def render_view(
    data: ViewData,
    title: str = "",
    *,
    links: RunLinks | None = None,
    live_url: str | None = None,
    assets: SharedAssets | None = None,
) -> str:
    """The page for a reduced bundle, as HTML text with everything inline. links: related
    runs' pages (a site's); live_url: where a served page hears of the bundle's growth;
    assets: a site's shared style and scripts, named instead of inlined."""
    page, payloads = _PageBuilder(data).build()
    page["rollout"] = rollout_extras(data.trace, links)
    page["live"] = live_url
    if assets is None:
        scripts = [_asset(script) for script in _SCRIPTS]
        style = f"<style>{_asset(_STYLE)}</style>"
        # Only these scripts may run, even if some text ever slipped through as markup.
        script_src = " ".join(map(script_hash, scripts))
        style_src = "'unsafe-inline'"
    else:
        scripts = [assets.loader]
        style = f'<link rel="stylesheet" href="{html.escape(assets.style)}">'
        script_src = f"{assets.loader_hash} 'strict-dynamic'"
        style_src = "'self' 'unsafe-inline'"
    values = {
        "TITLE": html.escape(title or f"rollout {data.trace.root_thread_id}"),
        "STYLE": style,
        "STYLE_SRC": style_src,
        "SCRIPT_SRC": script_src,
        # A static page fetches nothing; a served one asks its own server for updates.
        "CONNECT": "'self'" if live_url else "'none'",
        "SCRIPTS": "\n".join(f"<script>{script}</script>" for script in scripts),
        "DATA": _script_json(page),
        "PAYLOADS": _script_json(payloads),
    }
    # One pass over the template: text from the bundle is never scanned for placeholders.
    return _PLACEHOLDER.sub(lambda match: values[match[1]], _asset("_view.html"))


def save_view(
    data: ViewData,
    target: str | os.PathLike[str],
    title: str = "",
    *,
    links: RunLinks | None = None,
    assets: SharedAssets | None = None,
    mode: int = 0o666,
) -> Path:
    """Write the page of data to target (`mode` less the umask), replacing it whole; return
    the path."""
    return write_page(render_view(data, title, links=links, assets=assets), target, mode=mode)


def write_page(text: str, target: str | os.PathLike[str], *, mode: int = 0o666) -> Path:
    """Write a page to target, replacing it whole (a browser reloading it never sees half a
    page); return the path. Its mode is `mode` less the umask, as any new file's (0644 under
    umask 022): a page the user asked for is readable by a web server serving it."""
    return write_aside(target, lambda out: out.write(text.encode("utf-8")), mode=mode)


def write_view(
    bundle: str | os.PathLike[str], output: str | os.PathLike[str] | None = None
) -> Path:
    """Write the page of a bundle (default `<bundle>/view.html`); return its path.

    A damaged bundle is shown up to its damage. Raises BundleError when the path is not a
    bundle (or holds no header record), ReductionError when its records contradict each other.
    """
    trace_file = resolve_trace_file(bundle)
    data = reduce_for_view(trace_file)
    if data.trace.integrity.records_read == 0:
        raise NotABundleError(
            f"not a trace bundle (no header record): {bundle}: {data.trace.integrity.detail}"
        )
    title = f"rollout {trace_file.parent.name}"
    if output is None:
        # Inside the bundle, private as the bundle's own files (0600, in a 0700 directory).
        return save_view(data, trace_file.parent / VIEW_FILE_NAME, title, mode=0o600)
    return save_view(data, output, title)
