# The C extension's interface (_describe.c): parse_item's common case.

from collections.abc import Mapping
from typing import Any

def describe(data: bytes, /) -> Any: ...
def setup(
    loads: Any,
    dumps: Any,
    decode_error: type[BaseException],
    encode_error: type[BaseException],
    sort_option: int,
    item_info: type[tuple[Any, ...]],
    roles: Mapping[str, int],
    kinds: Mapping[str, int],
    kind_other: int,
    role_unspecified: int,
    role_tool: int,
    kind_function_call_output: int,
    kind_reasoning: int,
    max_depth: int,
    long_number: int,
    chat_message_key: str,
    /,
) -> None: ...
def item_wire(
    info: tuple[Any, ...],
    item_id: str,
    thread_id: str,
    turn_id: str,
    responses_item_id: str,
    seq: int,
    payload_id: str,
    seconds: int,
    nanos: int,
    producer: bytes,
    /,
) -> bytes | None: ...
def set_item_fields(numbers: tuple[int, ...], /) -> None: ...
