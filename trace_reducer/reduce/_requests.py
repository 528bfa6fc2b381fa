"""Rebuild the exact request body an inference call sent to the provider."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from rollout.trace.v1 import state_pb2

from ..bundle._errors import BundleError, PayloadError, RequestNotFoundError
from ..bundle._integrity import integrity_name, require_reducible
from ..bundle._payloads import PayloadStore, canonical_json, resolve_inputs
from ..bundle._reader import read_bundle
from ._chat import CHAT_API, chat_messages
from ._forks import BundleForkResolver
from ._parents import ParentBundle, fork_payload


def compose_request(
    envelope: dict[str, Any],
    items: list[Any],
    *,
    provider_api: str,
    instructions: str,
    input_as_string: bool = False,
) -> dict[str, Any]:
    """The body a call sent, from its recorded envelope and input items: `input` set (to the
    string it was sent as, with input_as_string: InferenceStarted.input_as_string), or for Chat
    Completions `messages` made from the thread's instructions and those items."""
    if provider_api == CHAT_API:
        envelope["messages"] = chat_messages(instructions, items)
    else:
        text = _string_input(items) if input_as_string else None
        envelope["input"] = items if text is None else text
    return envelope


def _string_input(items: list[Any]) -> str | None:
    """The text of a Responses `input` that is one user message `{"content": text, "role":
    "user"}`, which the API also takes as the string alone (its short form); None for any
    other input."""
    if len(items) != 1 or not isinstance(items[0], dict):
        return None
    (item,) = items
    content = item.get("content")
    if item.keys() == {"content", "role"} and item["role"] == "user" and isinstance(content, str):
        return content
    return None


def request_body(path: str | os.PathLike[str], inference_call_id: str) -> bytes:
    """The JSON body that inference call sent: its envelope with `input` set from its payloads
    (the string it was, when the call sent one; for Chat Completions, `messages` from the
    thread's instructions and those items).

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
    seen: list[str] = []  # the calls read, for a "not found" that says which there are

    def payload(pid: str) -> bytes:
        return fork_payload(payloads, parent, pid)

    with read_bundle(path) as reader:
        for record in reader:
            body = record.WhichOneof("body")
            try:
                if body == "payload":
                    payloads.add(record.payload)
                elif body == "thread_forked":
                    fork_prefix = list(record.thread_forked.prefix_payload_ids)
                    parent = BundleForkResolver(reader.bundle_dir, every_payload=True).resolve(
                        record.thread_forked
                    )
                elif body == "thread_started":
                    inputs_of_thread[record.thread_started.thread] = fork_prefix
                    instructions_of_thread[record.thread_started.thread] = (
                        record.thread_started.instructions_payload_id
                    )
                elif body == "turn_started":
                    thread_of_turn[record.turn_started.turn] = record.turn_started.thread
                elif body == "inference_started":
                    started = record.inference_started
                    seen.append(started.inference_call_id)
                    thread = thread_of_turn.get(started.turn, 0)
                    inputs = resolve_inputs(inputs_of_thread.get(thread, []), started)
                    inputs_of_thread[thread] = inputs
                    if started.inference_call_id == inference_call_id:
                        pid = instructions_of_thread.get(thread, "")
                        request = compose_request(
                            json.loads(payload(started.request_envelope_payload_id)),
                            [json.loads(payload(pid)) for pid in inputs],
                            provider_api=started.provider_api,
                            instructions=payload(pid).decode() if pid else "",
                            input_as_string=started.input_as_string,
                        )
                        return canonical_json(request)
            except (PayloadError, ValueError) as error:
                raise BundleError(f"seq {record.seq}: {error}") from error
            except RecursionError as error:
                raise BundleError(
                    f"seq {record.seq}: a payload of the request nests too deep to rebuild"
                ) from error
        integrity = reader.integrity
    # Not found: say so of what was read, which may be no bundle or stop at damage.
    require_reducible(integrity, salvage=True, source=str(path))
    if integrity.status in _DAMAGED:
        raise RequestNotFoundError(
            f"no inference call {inference_call_id!r} in the {integrity.records_read} records "
            f"of {path} before its damage ({integrity_name(integrity.status).lower()}: "
            f"{integrity.detail}); {_calls_there(seen)}"
        )
    raise RequestNotFoundError(
        f"no inference call {inference_call_id!r} in {path}; {_calls_there(seen)}"
    )


def _calls_there(seen: list[str]) -> str:
    return ids_there(seen, "inference call", "calls")


def ids_there(seen: Sequence[str], noun: str, plural: str, shown: int = 5) -> str:
    """Which ids the user may ask for instead of one a bundle does not have, the first
    `shown` of them (`dump` and state.json list every one): `its calls: inf_1, inf_2`."""
    if not seen:
        return f"it has no {noun}"
    more = f", … ({len(seen)} in all: `trace-reducer dump` lists them)" if len(seen) > shown else ""
    return f"its {plural}: {', '.join(seen[:shown])}{more}"


_DAMAGED = (state_pb2.INTEGRITY_STATUS_CORRUPT, state_pb2.INTEGRITY_STATUS_TRUNCATED)
