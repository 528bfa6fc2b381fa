"""Tokens in the trace: compact delta columns from provider logprobs and ids, per-call output
tokens in the reduced state, sampling settings from a request envelope, stop reasons."""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from typing import Any, TypeAlias

from rollout.trace.v1 import common_pb2, state_pb2

StopReason: TypeAlias = common_pb2.StopReason.ValueType
Status: TypeAlias = common_pb2.ExecutionStatus.ValueType

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_TOKEN_ID = 2**32 - 1
# Codes of failures that are the infrastructure's, not the model's or the provider's verdict.
INFRA_CODES = frozenset(
    {
        "connection_error",
        "stream_idle_timeout",
        "stream_ended",
        "internal",
        "request_not_sent",
        "unexpected_content_type",
        "unexpected_status",
        "bad_response",
        "malformed_event",
    }
)
LENGTH_REASONS = frozenset({"max_output_tokens", "max_tokens", "length"})


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        # JSON integers have no bound; a float32 column has.
        return math.nan


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _token_ids(value: Any) -> list[int] | None:
    if not isinstance(value, list):
        return None
    ids = []
    for entry in value:
        if isinstance(entry, bool) or not isinstance(entry, int) or not 0 <= entry <= MAX_TOKEN_ID:
            return None
        ids.append(entry)
    return ids


def delta_tokens(text: str, logprobs: Any, token_ids: Any) -> common_pb2.DeltaTokens | None:
    """The tokens a provider sent with one text event, as packed columns; None when it sent
    neither usable logprobs (`[{token, logprob, top_logprobs}]`) nor token ids.

    Token strings that concatenate to exactly `text` are kept as lengths (a byte or so each);
    anything malformed in the provider's lists is left out rather than guessed.
    """
    ids = _token_ids(token_ids)
    entries = (
        [entry for entry in logprobs if isinstance(entry, dict)]
        if isinstance(logprobs, list)
        else []
    )
    if not ids and not entries:
        return None
    tokens = common_pb2.DeltaTokens()
    if ids:
        tokens.ids.extend(ids)
    if entries:
        texts = [_text(entry.get("token")) for entry in entries]
        tokens.logprobs.extend(_float(entry.get("logprob")) for entry in entries)
        if "".join(texts) == text:
            tokens.text_lengths.extend(len(piece) for piece in texts)
        else:
            tokens.texts.extend(texts)
        tops = [entry.get("top_logprobs") for entry in entries]
        if any(isinstance(top, list) and top for top in tops):
            top_ids: list[int] = []
            all_ids = True
            for top in tops:
                alternatives = (
                    [alt for alt in top if isinstance(alt, dict)] if isinstance(top, list) else []
                )
                tokens.top_counts.append(len(alternatives))
                for alt in alternatives:
                    token = alt.get("token")
                    tokens.top_texts.append(token if isinstance(token, str) else "")
                    tokens.top_logprobs.append(_float(alt.get("logprob")))
                    alt_id = alt.get("token_id")
                    if (
                        isinstance(alt_id, int)
                        and not isinstance(alt_id, bool)
                        and (0 <= alt_id <= MAX_TOKEN_ID)
                    ):
                        top_ids.append(alt_id)
                    else:
                        all_ids = False
            if all_ids:
                tokens.top_ids.extend(top_ids)
    return tokens


def token_texts(tokens: common_pb2.DeltaTokens, text: str) -> list[str]:
    """The token strings of a delta's tokens ([] when the provider gave none)."""
    if tokens.texts:
        return list(tokens.texts)
    pieces = []
    start = 0
    for length in tokens.text_lengths:
        pieces.append(text[start : start + length])
        start += length
    return pieces


def sampling_settings(envelope: Mapping[str, Any]) -> common_pb2.SamplingSettings:
    """What a request body (or its envelope) asked for, in the Responses API's spelling or
    Chat Completions' (`max_tokens`, `logprobs: true`)."""
    settings = common_pb2.SamplingSettings()
    temperature = envelope.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool):
        settings.temperature = float(temperature)
    top_p = envelope.get("top_p")
    if isinstance(top_p, int | float) and not isinstance(top_p, bool):
        settings.top_p = float(top_p)
    limit = envelope.get("max_output_tokens", envelope.get("max_tokens"))
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 <= limit <= MAX_TOKEN_ID:
        settings.max_output_tokens = limit
    top = envelope.get("top_logprobs")
    if isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= MAX_TOKEN_ID:
        settings.top_logprobs = top
    include = envelope.get("include")
    settings.logprobs = (isinstance(include, list) and LOGPROBS_INCLUDE in include) or envelope.get(
        "logprobs"
    ) is True
    settings.token_ids = envelope.get("return_token_ids") is True
    return settings


def token_drift(shared: int, held: int, held_prompt: int) -> common_pb2.TokenDrift.ValueType:
    """How a prompt continues `held` tokens of which the first `held_prompt` are the previous
    prompt's, given that their first `shared` agree: EXACT when all held tokens agree,
    REALIGN when they part inside the previous output, FORK when before it."""
    if not held:
        return common_pb2.TOKEN_DRIFT_UNSPECIFIED
    if shared == held:
        return common_pb2.TOKEN_DRIFT_EXACT
    return common_pb2.TOKEN_DRIFT_REALIGN if shared >= held_prompt else common_pb2.TOKEN_DRIFT_FORK


def classify_stop(
    status: Status, *, reason: str = "", error_code: str = "", http_status: int = 0
) -> StopReason:
    """How an inference call ended, as a trainer sorts samples: the model's outcomes
    (completed, length) apart from interrupts, provider verdicts and infrastructure failures.

    A cut at the output limit (`response.incomplete:max_output_tokens`) is LENGTH whether the
    call completed with its partial answer (as the agent records it) or failed (older
    bundles)."""
    cut = reason.startswith("response.incomplete") and reason.rpartition(":")[2] in LENGTH_REASONS
    if cut and status in (
        common_pb2.EXECUTION_STATUS_COMPLETED,
        common_pb2.EXECUTION_STATUS_FAILED,
    ):
        return common_pb2.STOP_REASON_LENGTH
    if status == common_pb2.EXECUTION_STATUS_COMPLETED:
        return common_pb2.STOP_REASON_COMPLETED
    if status == common_pb2.EXECUTION_STATUS_CANCELLED:
        return common_pb2.STOP_REASON_INTERRUPTED
    if status != common_pb2.EXECUTION_STATUS_FAILED:
        return common_pb2.STOP_REASON_UNSPECIFIED
    if error_code in INFRA_CODES or http_status == 429 or http_status >= 500:
        return common_pb2.STOP_REASON_INFRA_ERROR
    return common_pb2.STOP_REASON_PROVIDER_ERROR


class TokenAccumulator:
    """One inference call's output tokens as they arrive, in columns kept aligned: a column a
    delta lacks is padded (id 0, logprob NaN) and the sequence is then no longer exact."""

    __slots__ = (
        "count",
        "has_ids",
        "has_logprobs",
        "has_texts",
        "has_top",
        "ids",
        "logprobs",
        "missing_ids",
        "spans",
        "texts",
        "top_counts",
        "top_ids",
        "top_logprobs",
        "top_texts",
    )

    def __init__(self) -> None:
        self.ids = array("I")
        self.logprobs = array("f")
        self.texts: list[str] = []
        self.top_counts = array("I")
        self.top_texts: list[str] = []
        self.top_logprobs = array("f")
        self.top_ids = array("I")
        self.count = 0
        self.has_ids = self.has_logprobs = self.has_texts = self.has_top = False
        self.missing_ids = False
        # [output key, start, count]; the key becomes an item id once the output is accepted.
        self.spans: list[list[Any]] = []

    def add(self, key: object, tokens: common_pb2.DeltaTokens, text: str) -> None:
        texts = token_texts(tokens, text)
        count = max(len(tokens.ids), len(tokens.logprobs), len(texts))
        if not count:
            return
        before = self.count
        if tokens.ids:
            if not self.has_ids:
                self.ids.extend([0] * before)
                self.missing_ids = self.missing_ids or before > 0
                self.has_ids = True
            self.ids.extend(tokens.ids)
            self.ids.extend([0] * (count - len(tokens.ids)))
            self.missing_ids = self.missing_ids or len(tokens.ids) < count
        elif self.has_ids:
            self.ids.extend([0] * count)
            self.missing_ids = True
        else:
            self.missing_ids = True
        if tokens.logprobs:
            if not self.has_logprobs:
                self.logprobs.extend([math.nan] * before)
                self.has_logprobs = True
            self.logprobs.extend(tokens.logprobs)
            self.logprobs.extend([math.nan] * (count - len(tokens.logprobs)))
        elif self.has_logprobs:
            self.logprobs.extend([math.nan] * count)
        if texts:
            if not self.has_texts:
                self.texts.extend([""] * before)
                self.has_texts = True
            self.texts.extend(texts)
            self.texts.extend([""] * (count - len(texts)))
        elif self.has_texts:
            self.texts.extend([""] * count)
        if tokens.top_counts or self.has_top:
            if not self.has_top:
                self.top_counts.extend([0] * before)
                self.has_top = True
            # Each token's alternatives as many as its count says and the lists hold: a delta
            # whose counts and lists disagree (a crafted or damaged bundle) put every later
            # token's alternatives out of step, and reading them past the end failed.
            texts_given = list(tokens.top_texts)
            logprobs_given = list(tokens.top_logprobs)
            left = max(len(texts_given), len(logprobs_given))
            counts = []
            for claimed in list(tokens.top_counts)[:count]:
                taken = min(claimed, left)
                counts.append(taken)
                left -= taken
            counts += [0] * (count - len(counts))
            used = sum(counts)
            self.top_counts.extend(counts)
            self.top_texts.extend(texts_given[:used])
            self.top_texts.extend([""] * (used - min(used, len(texts_given))))
            self.top_logprobs.extend(logprobs_given[:used])
            self.top_logprobs.extend([math.nan] * (used - min(used, len(logprobs_given))))
            # Ids short of the count leave the column shorter than the texts: it is left out.
            self.top_ids.extend(list(tokens.top_ids)[:used])
        self.count += count
        if self.spans and self.spans[-1][0] is key:
            self.spans[-1][2] += count
        else:
            self.spans.append([key, before, count])

    def name(self, key: object, item_id: str) -> None:
        """The output `key` was accepted as conversation item `item_id`."""
        for span in self.spans:
            if span[0] is key:
                span[0] = item_id

    def to_proto(self) -> state_pb2.OutputTokens:
        out = state_pb2.OutputTokens(count=self.count)
        if self.has_ids:
            out.ids.extend(self.ids)
        if self.has_logprobs:
            out.logprobs.extend(self.logprobs)
        if self.has_texts:
            out.texts.extend(self.texts)
        if self.has_top:
            out.top_counts.extend(self.top_counts)
            out.top_texts.extend(self.top_texts)
            out.top_logprobs.extend(self.top_logprobs)
            if len(self.top_ids) == len(self.top_texts):
                out.top_ids.extend(self.top_ids)
        if self.has_ids:
            out.source = common_pb2.TOKEN_SOURCE_ENGINE
            out.exact = not self.missing_ids
        elif self.has_logprobs or self.has_texts:
            out.source = common_pb2.TOKEN_SOURCE_LOGPROBS
        for key, start, count in self.spans:
            out.spans.add(item_id=key if isinstance(key, str) else "", start=start, count=count)
        return out
