"""Rebuild the exact request body an inference call sent to the provider."""

from __future__ import annotations

import json
import os

from ._errors import BundleError
from ._payloads import PayloadError, PayloadStore, canonical_json, resolve_inputs
from ._reader import read_bundle


class RequestNotFoundError(BundleError):
    """The bundle has no inference call with the id asked for."""


def request_body(path: str | os.PathLike[str], inference_call_id: str) -> bytes:
    """The JSON body that inference call sent: its envelope with `input` set from its payloads.

    Raises RequestNotFoundError when the bundle (up to any damage) has no such call, and
    BundleError when its records do not fit together.
    """
    # Every payload until the call is found: its history may go back to the first turn.
    payloads = PayloadStore(budget=None)
    thread_of_turn: dict[int, int] = {}
    inputs_of_thread: dict[int, list[str]] = {}
    with read_bundle(path) as reader:
        for record in reader:
            body = record.WhichOneof("body")
            try:
                if body == "payload":
                    payloads.add(record.payload)
                elif body == "turn_started":
                    thread_of_turn[record.turn_started.turn] = record.turn_started.thread
                elif body == "inference_started":
                    started = record.inference_started
                    thread = thread_of_turn.get(started.turn, 0)
                    inputs = resolve_inputs(inputs_of_thread.get(thread, []), started)
                    inputs_of_thread[thread] = inputs
                    if started.inference_call_id == inference_call_id:
                        request = json.loads(payloads.get(started.request_envelope_payload_id))
                        request["input"] = [json.loads(payloads.get(pid)) for pid in inputs]
                        return canonical_json(request)
            except (PayloadError, ValueError) as error:
                raise BundleError(f"seq {record.seq}: {error}") from error
            except RecursionError as error:
                raise BundleError(
                    f"seq {record.seq}: a payload of the request nests too deep to rebuild"
                ) from error
    raise RequestNotFoundError(f"no inference call {inference_call_id!r} in {path}")
