# The C extension's interface (_canonical.c): a payload's JSON encoding.

from typing import Any

def encode(value: Any, /) -> bytes | None: ...
