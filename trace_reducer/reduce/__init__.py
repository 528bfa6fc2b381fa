"""The reducer and what it builds: items, the compact form, forks, requests, state JSON."""

from ..bundle._errors import RequestNotFoundError
from ._chat import CHAT_API, chat_messages
from ._compact import expand_request_items
from ._recorded import (
    RecordedSummary,
    RecordedThread,
    TurnNotEndedError,
    TurnNotRecordedError,
    list_recorded,
    load_recorded,
)
from ._reducer import Reducer
from ._replay import replay_bundle
from ._requests import request_body
from ._state_json import iter_state_json, state_to_json, write_state_json

__all__ = [
    "CHAT_API",
    "RecordedSummary",
    "RecordedThread",
    "Reducer",
    "RequestNotFoundError",
    "TurnNotEndedError",
    "TurnNotRecordedError",
    "chat_messages",
    "expand_request_items",
    "iter_state_json",
    "list_recorded",
    "load_recorded",
    "replay_bundle",
    "request_body",
    "state_to_json",
    "write_state_json",
]
