"""Rebuild the exact request body an inference call sent to the provider."""

from __future__ import annotations

import json
import os

from ..bundle._errors import BundleError, PayloadError, RequestNotFoundError
from ..bundle._payloads import PayloadStore, canonical_json, resolve_inputs
from ..bundle._reader import read_bundle
from ._chat import CHAT_API, chat_messages
from ._forks import BundleForkResolver
from ._parents import ParentBundle


def request_body(path: str | os.PathLike[str], inference_call_id: str) -> bytes:
    """The JSON body that inference call sent: its envelope with `input` set from its payloads
    (for Chat Completions, `messages` from the thread's instructions and those items).

    Raises RequestNotFoundError when the bundle (up to any damage) has no such call, and
    BundleError when its records do not fit together.
    """
    # Every payload until the call is found: its history may go back to the first turn.
    payloads = PayloadStore(budget=None)
    thread_of_turn: dict[int, int] = {}
    inputs_of_thread: dict[int, list[str]] = {}
    instructions_of_thread: dict[int, str] = {}
    fork_prefix: list[str] = []
    parent: ParentBundle | None = None

    def payload(pid: str) -> bytes:
        # A fork's shared payloads are its parent's.
        try:
            return payloads.get(pid)
        except PayloadError:
            data = parent.payload(pid) if parent is not None else None
            if data is None:
                raise
            return data

    with read_bundle(path) as reader:
        for record in reader:
            body = record.WhichOneof("body")
            try:
                if body == "payload":
                    payloads.add(record.payload)
                elif body == "thread_forked":
                    fork_prefix = list(record.thread_forked.prefix_payload_ids)
                    parent = BundleForkResolver(reader.bundle_dir).resolve(record.thread_forked)
                elif body == "thread_started":
                    inputs_of_thread[record.thread_started.thread] = fork_prefix
                    instructions_of_thread[record.thread_started.thread] = (
                        record.thread_started.instructions_payload_id
                    )
                elif body == "turn_started":
                    thread_of_turn[record.turn_started.turn] = record.turn_started.thread
                elif body == "inference_started":
                    started = record.inference_started
                    thread = thread_of_turn.get(started.turn, 0)
                    inputs = resolve_inputs(inputs_of_thread.get(thread, []), started)
                    inputs_of_thread[thread] = inputs
                    if started.inference_call_id == inference_call_id:
                        request = json.loads(payload(started.request_envelope_payload_id))
                        items = [json.loads(payload(pid)) for pid in inputs]
                        if started.provider_api == CHAT_API:
                            pid = instructions_of_thread.get(thread, "")
                            instructions = payload(pid).decode() if pid else ""
                            request["messages"] = chat_messages(instructions, items)
                        else:
                            request["input"] = items
                        return canonical_json(request)
            except (PayloadError, ValueError) as error:
                raise BundleError(f"seq {record.seq}: {error}") from error
            except RecursionError as error:
                raise BundleError(
                    f"seq {record.seq}: a payload of the request nests too deep to rebuild"
                ) from error
    raise RequestNotFoundError(f"no inference call {inference_call_id!r} in {path}")
