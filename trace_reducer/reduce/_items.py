"""Conversation items: parsing payload JSON, normalising it, matching requests to history."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple, TypeVar

import orjson
from google.protobuf import timestamp_pb2

from rollout.trace.v1 import state_pb2

from ..bundle._payloads import LONG_NUMBER_DIGITS, canonical_json, fast_json
from ._chat import CHAT_MESSAGE_KEY

try:
    from . import _describe
except ImportError:  # not built (no C compiler): every item takes the Python way
    _describe = None  # type: ignore[assignment]

_ROLES: dict[str, state_pb2.ConversationRole.ValueType] = {
    "user": state_pb2.CONVERSATION_ROLE_USER,
    "assistant": state_pb2.CONVERSATION_ROLE_ASSISTANT,
    "system": state_pb2.CONVERSATION_ROLE_SYSTEM,
    "developer": state_pb2.CONVERSATION_ROLE_DEVELOPER,
    "tool": state_pb2.CONVERSATION_ROLE_TOOL,
}

_KINDS: dict[str, state_pb2.ItemKind.ValueType] = {
    "message": state_pb2.ITEM_KIND_MESSAGE,
    "function_call": state_pb2.ITEM_KIND_FUNCTION_CALL,
    "function_call_output": state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT,
    "reasoning": state_pb2.ITEM_KIND_REASONING,
}

# Deeper items are opaque: real ones nest a few levels, and walking (or re-encoding) a
# crafted one thousands of levels deep would exhaust the interpreter's stack.
MAX_ITEM_DEPTH = 200
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class ItemInfo(NamedTuple):
    """What the reducer needs to know about one Responses API item.

    A named tuple: immutable as a frozen dataclass is, and made in one C call where a frozen
    dataclass sets each field through object.__setattr__ (every item of a replay makes one).
    """

    key: Hashable
    """Normalised content: equal keys mean the model saw the same thing."""
    responses_item_id: str
    role: state_pb2.ConversationRole.ValueType
    kind: state_pb2.ItemKind.ValueType
    content: tuple[tuple[str, str], ...]
    call_id: str
    # A function call's name and arguments; a function call output's text.
    name: str = ""
    arguments: str = ""
    output: str = ""

    def fill(self, item: state_pb2.ConversationItem) -> None:
        """Copy role, kind, content and the function-call fields into a conversation item."""
        # Only what is not the default: none of these fields has presence, and each set costs
        # a call into the message library (most items have no call id, name or output).
        if self.role:
            item.role = self.role
        if self.kind:
            item.kind = self.kind
        if self.call_id:
            item.call_id = self.call_id
        if self.name:
            item.name = self.name
        if self.arguments:
            item.arguments = self.arguments
        if self.output:
            item.output = self.output
        for part_type, text in self.content:
            item.content.add(type=part_type, text=text)


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _parts(value: object, default_type: str) -> tuple[tuple[str, str], ...]:
    if isinstance(value, str):
        return ((default_type, value),)
    if not isinstance(value, list):
        return ()
    # A refusal part carries its text under `refusal`, not `text`. A list made then frozen:
    # tuple() over a generator costs a frame switch per part.
    return tuple(
        [
            (_text(part.get("type")), _text(part.get("text", part.get("refusal"))))
            for part in value
            if isinstance(part, dict)
        ]
    )


_ASSISTANT = "assistant"
_ASSISTANT_TEXT = "output_text"
_INPUT_TEXT = "input_text"
# A Chat message's text part (`chat_items` keeps a content list as the client sent it).
_CHAT_TEXT = "text"


def _part_type(part_type: object, text_type: str) -> object:
    """A text part's type in the matching key: Chat's `text` is its role's Responses type."""
    return text_type if part_type == _CHAT_TEXT else part_type


def _opaque(key: str) -> ItemInfo:
    return ItemInfo(
        key, "", state_pb2.CONVERSATION_ROLE_UNSPECIFIED, state_pb2.ITEM_KIND_OTHER, (), ""
    )


def nested_deeper_than(value: object, limit: int) -> bool:
    """Whether containers nest more than limit deep below value (recursion at most limit
    deep: a value json parsed can be nested past what json encodes again, or Python recurses)."""
    if isinstance(value, dict):
        children: Iterable[object] = value.values()
    elif isinstance(value, list):
        children = value
    else:
        return False
    if limit == 0:
        return True
    return any(
        isinstance(child, dict | list) and nested_deeper_than(child, limit - 1)
        for child in children
    )


def _without_lone_surrogates(value: object) -> object:
    """value with every lone surrogate (a JSON `\\udc00` escape) in its strings as U+FFFD."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_without_lone_surrogates(child) for child in value]
    if isinstance(value, dict):
        return {
            _LONE_SURROGATE.sub("\ufffd", key): _without_lone_surrogates(child)
            for key, child in value.items()
        }
    return value


def parse_item(data: bytes) -> ItemInfo:
    """Describe one item from its JSON bytes; never raises.

    Text is valid Unicode: bytes that are not UTF-8 and lone surrogates become U+FFFD. What is
    not a JSON object, or nests deeper than MAX_ITEM_DEPTH, is an opaque item: no role, kind
    OTHER, no content, matched by its bytes.
    """
    if _describe is not None:
        # The common case in one C call (_describe.c), the same steps as _parse_item's; None
        # for whatever needs one of the Python way's other branches.
        described: ItemInfo | None = _describe.describe(data)
        if described is not None:
            return described
    return _parse_item(data)


def _parse_item(data: bytes) -> ItemInfo:
    """parse_item the Python way: the reference _describe.c follows, and every case it leaves."""
    # orjson reads what json reads, to the same values, or refuses it (invalid UTF-8, lone
    # surrogates, NaN, infinities, nesting past 1,024): what it refuses json reads as before.
    # Its way is ten times cheaper, which is most of what an item costs a replay.
    fast, parsed = fast_json(data)
    if not fast:
        text = data.decode("utf-8", "replace")
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):
            return _opaque(text)
    # Nesting deeper than the limit needs more opening brackets than the limit, so most
    # payloads are not walked at all.
    if (
        len(data) > MAX_ITEM_DEPTH
        and data.count(b"[") + data.count(b"{") > MAX_ITEM_DEPTH
        and nested_deeper_than(parsed, MAX_ITEM_DEPTH)
    ):
        return _opaque(data.decode("utf-8", "replace"))
    # Only an escape can spell a lone surrogate (bytes that would were replaced above, and
    # orjson refuses both); a payload without a backslash, most of them, is not even searched.
    if not fast and b"\\" in data and _SURROGATE_ESCAPE.search(data):
        parsed = _without_lone_surrogates(parsed)
    if not isinstance(parsed, dict):
        return _opaque(_canonical(parsed))
    # A copy (made whole in C) without the fields that change between the provider's copy of
    # an item and the copy sent back as input, without changing what the model sees.
    normalised = parsed.copy()
    normalised.pop("id", None)
    normalised.pop("status", None)
    # How a Chat client spelt the message (chat_items): not what the model saw, and a tool
    # call echoed back matches the call the model made.
    normalised.pop(CHAT_MESSAGE_KEY, None)
    item_type = parsed.get("type")
    if item_type is None and "role" in parsed:
        # The short input form {"role", "content"} is a message.
        item_type = "message"
        normalised["type"] = item_type
    content = parsed.get("content")
    # Text as a string or a Chat `text` part is the part its role's messages have: the model's
    # answer is output_text, and a Chat client sends it back as a string (was: keyed as
    # input_text, so every answer a Chat conversation sent back was recorded again).
    text_type = _ASSISTANT_TEXT if parsed.get("role") == _ASSISTANT else _INPUT_TEXT
    if isinstance(content, str):
        normalised["content"] = [{"type": text_type, "text": content}]
    elif isinstance(content, list):
        # Text parts collect annotations and logprobs on the way out that are not sent back
        # in; other parts (images, files) are only distinguishable by all of their fields.
        normalised["content"] = [
            {"type": _part_type(part.get("type", ""), text_type), "text": part["text"]}
            if isinstance(part, dict) and "text" in part
            else part
            for part in content
        ]
    kind = state_pb2.ITEM_KIND_OTHER
    if isinstance(item_type, str):
        kind = _KINDS.get(item_type, kind)
    role = _ROLES.get(_text(parsed.get("role")), state_pb2.CONVERSATION_ROLE_UNSPECIFIED)
    if role == state_pb2.CONVERSATION_ROLE_UNSPECIFIED and kind == (
        state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT
    ):
        role = state_pb2.CONVERSATION_ROLE_TOOL
    if kind == state_pb2.ITEM_KIND_REASONING:
        parts = _parts(parsed.get("summary"), "summary_text")
    else:
        # A string's part is its role's text, as in the key (was: input_text for every role,
        # so an assistant's few-shot example a Chat client sent showed as input_text).
        parts = _parts(content, text_type)
    return ItemInfo(
        key=_key(normalised),
        responses_item_id=_text(parsed.get("id")),
        role=role,
        kind=kind,
        content=parts,
        call_id=_text(parsed.get("call_id")),
        name=_text(parsed.get("name")),
        arguments=_text(parsed.get("arguments")),
        output=_output_text(parsed.get("output")),
    )


def _item_fields() -> tuple[int, ...]:
    """The field numbers _describe.item_wire writes, in the order set_item_fields takes them."""
    item = state_pb2.ConversationItem.DESCRIPTOR.fields_by_name
    part = state_pb2.ContentPart.DESCRIPTOR.fields_by_name
    stamp = timestamp_pb2.Timestamp.DESCRIPTOR.fields_by_name
    names = (
        "item_id",
        "thread_id",
        "turn_id",
        "responses_item_id",
        "first_seen_seq",
        "payload_id",
        "role",
        "kind",
        "call_id",
        "name",
        "arguments",
        "output",
        "content",
        "first_seen_at",
        "produced_by",
    )
    return (
        *(item[name].number for name in names),
        part["type"].number,
        part["text"].number,
        stamp["seconds"].number,
        stamp["nanos"].number,
    )


if _describe is not None:
    _describe.setup(
        orjson.loads,
        orjson.dumps,
        orjson.JSONDecodeError,
        orjson.JSONEncodeError,
        orjson.OPT_SORT_KEYS,
        ItemInfo,
        _ROLES,
        _KINDS,
        state_pb2.ITEM_KIND_OTHER,
        state_pb2.CONVERSATION_ROLE_UNSPECIFIED,
        state_pb2.CONVERSATION_ROLE_TOOL,
        state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT,
        state_pb2.ITEM_KIND_REASONING,
        MAX_ITEM_DEPTH,
        LONG_NUMBER_DIGITS,
        CHAT_MESSAGE_KEY,
    )
    _describe.set_item_fields(_item_fields())

# A new conversation item's message, encoded in one C call: item_wire(info, item_id,
# thread_id, turn_id, responses_item_id, seq, payload_id, seconds, nanos, producer) -> bytes,
# or None where the message library must take the values itself. None where not built.
item_wire = _describe.item_wire if _describe is not None else None


def _key(value: dict[str, object]) -> Hashable:
    """An item's matching key: its canonical JSON (orjson's, keys sorted), equal exactly when
    the values are; _frozen's tuples for what JSON text cannot tell apart (a NaN, an infinity:
    orjson writes them as null) or orjson cannot write (integers past 64 bits)."""
    try:
        key = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        return _frozen(value)
    if b"null" in key and not _finite(value):
        return _frozen(value)
    return key


def _finite(value: object) -> bool:
    """Whether no float below value is a NaN or an infinity."""
    if isinstance(value, float):
        return value - value == 0.0
    if isinstance(value, dict):
        return all(map(_finite, value.values()))
    if isinstance(value, list):
        return all(map(_finite, value))
    return True


def _frozen(value: object) -> Hashable:
    """A JSON value as nested tuples: equal exactly when their canonical JSON is.

    Cheaper than encoding it (text is kept, not copied); numbers and booleans carry their type,
    as JSON tells 1, 1.0 and true apart where Python does not.
    """
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, dict):
        return ("{", tuple(sorted((key, _frozen(child)) for key, child in value.items())))
    if isinstance(value, list):
        return ("[", tuple(_frozen(child) for child in value))
    if isinstance(value, float):
        return ("f", repr(value))
    return ("b" if isinstance(value, bool) else "i", value)


def _output_text(value: object) -> str:
    """A function call output's text: the string, or the text of its parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(part.get("text")) for part in value if isinstance(part, dict))
    return ""


def _canonical(value: object) -> str:
    return canonical_json(value).decode("ascii")


class ThreadItems:
    """The conversation items of one thread, indexed for matching the next request's input."""

    __slots__ = (
        "_by_key",
        "_by_responses_id",
        "_generation",
        "_in_request",
        "_key_cursors",
        "_previous_ids",
        "_previous_keys",
        "_responses_id_cursors",
    )

    def __init__(self) -> None:
        self._by_key: dict[Hashable, list[str]] = {}
        self._by_responses_id: dict[str, list[str]] = {}
        # The previous request: the key and the matched item id of each of its inputs, and the
        # same ids as a set. Each request changes them in place from where it departs from the
        # previous one, so a long conversation costs what its new inputs cost.
        self._previous_keys: list[Hashable] = []
        self._previous_ids: list[str] = []
        self._in_request: set[str] = set()
        # For each list of _by_key and _by_responses_id searched: how many of its first items
        # are in _in_request, and the generation that is true for. _in_request only grows
        # while a request is matched, and loses items only where a request departs from the
        # previous one (a new generation), so the count holds until then; without it each
        # input repeating a content (the same tool call and output every turn) would walk every
        # earlier copy, a thread costing the square of its length.
        self._key_cursors: dict[Hashable, tuple[int, int]] = {}
        self._responses_id_cursors: dict[str, tuple[int, int]] = {}
        self._generation = 0

    def register(self, item_id: str, key: Hashable, responses_item_id: str) -> None:
        """Make an item of the thread findable by its content and its Responses id."""
        self._by_key.setdefault(key, []).append(item_id)
        if responses_item_id:
            self._by_responses_id.setdefault(responses_item_id, []).append(item_id)

    def previous_ids(self, count: int) -> list[str]:
        """The item ids of the first `count` inputs of the previous request."""
        return self._previous_ids[:count]

    def match_request(
        self, inputs: Sequence[ItemInfo], new_item: Callable[[int], str], *, known: int = 0
    ) -> list[str]:
        """The item ids of `inputs`, in order; new_item(index) creates (and registers) the rest.

        The request is the first `known` inputs of the previous request, which `inputs` leaves
        out (indexes count from there), then `inputs`; those known ones are the previous
        request's items, and only the ids of `inputs` are returned.

        Tried in order for each input: the same content at the same position of the previous
        request; an item not yet in this request whose Responses id is the input's `id`; the
        first-seen such item with the same content; otherwise a new item.
        """
        previous_ids = self._previous_ids
        previous_keys = self._previous_keys
        if known > len(previous_ids):
            raise ValueError(f"{known} known inputs, the previous request had fewer")
        in_request = self._in_request
        # Where this request departs from the previous one, the rest of that one is no longer
        # in it; those positions still count for the first rule.
        tail_ids = previous_ids[known:]
        tail_keys = previous_keys[known:]
        del previous_ids[known:]
        del previous_keys[known:]
        if tail_ids:
            in_request.difference_update(tail_ids)
            self._generation += 1
        generation = self._generation
        matched: list[str] = []
        for index, info in enumerate(inputs):
            item_id = None
            if index < len(tail_ids):
                candidate = tail_ids[index]
                if tail_keys[index] == info.key and candidate not in in_request:
                    item_id = candidate
            if item_id is None and info.responses_item_id:
                item_id = _first_unused(
                    self._by_responses_id,
                    self._responses_id_cursors,
                    info.responses_item_id,
                    in_request,
                    generation,
                )
            if item_id is None:
                item_id = _first_unused(
                    self._by_key, self._key_cursors, info.key, in_request, generation
                )
            if item_id is None:
                item_id = new_item(index)
            in_request.add(item_id)
            matched.append(item_id)
            previous_keys.append(info.key)
        previous_ids.extend(matched)
        return matched


_Key = TypeVar("_Key", bound=Hashable)


def _first_unused(
    index: dict[_Key, list[str]],
    cursors: dict[_Key, tuple[int, int]],
    key: _Key,
    used: set[str],
    generation: int,
) -> str | None:
    """The first item of index[key] not in `used`, starting past those its cursor counts."""
    candidates = index.get(key)
    if not candidates:
        return None
    cursor = cursors.get(key)
    position = cursor[1] if cursor is not None and cursor[0] == generation else 0
    while position < len(candidates) and candidates[position] in used:
        position += 1
    cursors[key] = (generation, position)
    return candidates[position] if position < len(candidates) else None
