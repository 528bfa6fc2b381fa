"""The built-in local model's toy tokenizer and chat template: deterministic token ids and
logprobs, so token capture, forks and training exports run offline.

Text splits into words with their leading white space, each cut into pieces of at most four
characters; a piece's id is a hash of it. Every item of a conversation renders as
`<start> role: body <end>`, and a prompt ends with `<start> assistant:`, so the prompt of the next
request is exactly this prompt, then the tokens generated, then the items that followed (the
property a trainer needs to keep one token sequence per conversation).
"""

from __future__ import annotations

import re
import zlib
from typing import Any

START = 1
END = 2
START_TEXT = "<|start|>"
END_TEXT = "<|end|>"
_VOCAB = 50_000
_FIRST_ID = 3
_PIECE_CHARS = 4
_WORDS = re.compile(r"\s*\S+|\s+")


def pieces(text: str) -> list[str]:
    """The token strings of text, in order; they concatenate to text."""
    out: list[str] = []
    for word in _WORDS.findall(text):
        out.extend(word[i : i + _PIECE_CHARS] for i in range(0, len(word), _PIECE_CHARS))
    return out


def piece_id(piece: str) -> int:
    return _FIRST_ID + zlib.crc32(piece.encode()) % _VOCAB


def encode(text: str) -> list[int]:
    return [piece_id(piece) for piece in pieces(text)]


def token_text(token_id: int, piece: str | None = None) -> str:
    if token_id == START:
        return START_TEXT
    if token_id == END:
        return END_TEXT
    return piece or ""


def header(role: str) -> list[int]:
    """The tokens that open an item of `role`."""
    return [START, *encode(f"{role}:")]


def header_texts(role: str) -> list[str]:
    return [START_TEXT, *pieces(f"{role}:")]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def call_opening(name: str) -> list[str]:
    """The token strings a function call's tokens start with, before its arguments'."""
    return pieces(f"call {name}")


def item_ids(item: Any) -> list[int]:
    """A Responses API item as the template renders it: `<start> role: body <end>`; a
    function call's body is `call NAME` then its arguments, each tokenized on its own."""
    if not isinstance(item, dict):
        return [*header("user"), END]
    kind = item.get("type", "message")
    if kind == "function_call":
        name, arguments = str(item.get("name", "")), str(item.get("arguments", ""))
        body = [piece_id(p) for p in call_opening(name)] + encode(arguments)
        return [*header("assistant"), *body, END]
    if kind == "function_call_output":
        return [*header("tool"), *encode(str(item.get("output", ""))), END]
    role = str(item.get("role", "user"))
    return [*header(role), *encode(_text_of(item.get("content"))), END]


def render_prompt(instructions: Any, input_items: Any) -> list[int]:
    """The prompt's token ids: instructions, every input item, then the generation header."""
    ids: list[int] = []
    if isinstance(instructions, str) and instructions:
        ids += [*header("system"), *encode(instructions), END]
    for item in input_items if isinstance(input_items, list) else []:
        ids += item_ids(item)
    return ids + header("assistant")


def logprob(token_id: int, position: int) -> float:
    """A deterministic log probability for the token sampled at `position`."""
    return -(((token_id * 2_654_435_761) + position * 97) % 2_000) / 1_000.0 - 0.001


def logprob_entries(
    ids: list[int], texts: list[str], position: int, top: int
) -> list[dict[str, Any]]:
    """Responses API `logprobs` entries for tokens sampled from `position` on, with `top`
    alternatives each (the sampled token first, as a sampler ranks it)."""
    entries = []
    for offset, (token_id, text) in enumerate(zip(ids, texts, strict=True)):
        chosen = logprob(token_id, position + offset)
        entry: dict[str, Any] = {"token": text, "logprob": chosen, "bytes": list(text.encode())}
        if top:
            alternatives = [{"token": text, "logprob": chosen, "token_id": token_id}]
            for rank in range(1, top):
                alt_id = _FIRST_ID + (token_id + rank * 7919) % _VOCAB
                alternatives.append(
                    {"token": f"<{alt_id}>", "logprob": chosen - rank * 0.5, "token_id": alt_id}
                )
            entry["top_logprobs"] = alternatives
        else:
            entry["top_logprobs"] = []
        entries.append(entry)
    return entries
