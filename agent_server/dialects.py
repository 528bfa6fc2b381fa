"""The provider dialects by name, and the request fields a provider's capabilities rule out."""

from __future__ import annotations

from collections.abc import Iterable

from agent_server.chat_completions import CHAT
from agent_server.provider import RESPONSES, Dialect

DIALECTS: dict[str, Dialect] = {RESPONSES.name: RESPONSES, CHAT.name: CHAT}
# The optional request fields each capability stands for (Responses' and Chat's spellings).
_FIELDS_OF = {
    "token-ids": frozenset({"return_token_ids"}),
    "logprobs": frozenset({"logprobs", "top_logprobs", "include"}),
}


def dialect_named(name: str) -> Dialect:
    """The dialect of `--provider-api NAME` (Settings has checked the name)."""
    return DIALECTS[name]


def unsupported_fields(capabilities: Iterable[str]) -> frozenset[str]:
    """The optional fields a provider with these capabilities is never sent (best effort)."""
    offered = set(capabilities)
    return frozenset().union(
        *(fields for capability, fields in _FIELDS_OF.items() if capability not in offered)
    )


__all__ = ["DIALECTS", "dialect_named", "unsupported_fields"]
