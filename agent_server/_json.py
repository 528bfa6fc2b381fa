"""The one JSON encoding of payloads and request bodies, so a request is reconstructible."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    """Compact JSON with sorted keys: re-encoding a decoded payload gives the same bytes."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
