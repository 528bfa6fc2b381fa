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
    /,
) -> None: ...
