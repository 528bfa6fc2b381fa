"""The reducer and what it builds: items, the compact form, forks, requests, state JSON."""

from ..bundle._errors import RequestNotFoundError
from ._chat import CHAT_API, chat_messages
from ._compact import expand_request_items
from ._reducer import Reducer
from ._replay import replay_bundle
from ._requests import request_body
from ._state_json import iter_state_json, state_to_json, write_state_json

__all__ = [
    "CHAT_API",
    "Reducer",
    "RequestNotFoundError",
    "chat_messages",
    "expand_request_items",
    "iter_state_json",
    "replay_bundle",
    "request_body",
    "state_to_json",
    "write_state_json",
]
