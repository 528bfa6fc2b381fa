# The C extension's interface (_sse_split.c): a provider read's events in one call.

from typing import Any

def parse_events(block: bytes, /) -> list[Any] | None: ...
def responses_events(block: bytes, /) -> list[Any] | None: ...
def setup_sse(sse_event: type[tuple[Any, ...]], /) -> None: ...
def setup_events(
    provider_event: type[tuple[Any, ...]],
    loads: Any,
    decode_error: type[BaseException],
    max_depth: int,
    long_number: int,
    /,
) -> None: ...
