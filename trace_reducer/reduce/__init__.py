"""The reducer and what it builds: items, the compact form, forks, requests, state JSON,
recorded calls and run comparison."""

from ..bundle._errors import RequestNotFoundError
from ._chat import CHAT_API, chat_items, chat_messages
from ._compact import expand_request_items
from ._diff import (
    REPLAY_IGNORED_FIELDS,
    REPLAY_IGNORED_ITEM_FIELDS,
    Difference,
    RunDiff,
    body_diff,
    comparable_request,
    diff_runs,
    request_difference,
)
from ._items import nested_deeper_than
from ._recorded import (
    RecordedCall,
    RecordedThread,
    bundle_paths,
    group_repetitions,
    read_recorded,
    read_recorded_thread,
)
from ._reducer import Reducer
from ._replay import replay_bundle, replay_confined
from ._requests import request_body
from ._state_json import iter_state_json, state_to_json, write_state_json
from ._stored import (
    RecordedSummary,
    StoredThread,
    TurnNotEndedError,
    TurnNotRecordedError,
    list_recorded,
    load_recorded,
)

__all__ = [
    "CHAT_API",
    "REPLAY_IGNORED_FIELDS",
    "REPLAY_IGNORED_ITEM_FIELDS",
    "Difference",
    "RecordedCall",
    "RecordedSummary",
    "RecordedThread",
    "Reducer",
    "RequestNotFoundError",
    "RunDiff",
    "StoredThread",
    "TurnNotEndedError",
    "TurnNotRecordedError",
    "body_diff",
    "bundle_paths",
    "chat_items",
    "chat_messages",
    "comparable_request",
    "diff_runs",
    "expand_request_items",
    "group_repetitions",
    "iter_state_json",
    "list_recorded",
    "load_recorded",
    "nested_deeper_than",
    "read_recorded",
    "read_recorded_thread",
    "replay_bundle",
    "replay_confined",
    "request_body",
    "request_difference",
    "state_to_json",
    "write_state_json",
]
