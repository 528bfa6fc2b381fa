"""The built-in offline model: deterministic replies and tool calls, streamed in both
dialects (`POST /responses` and `POST /chat/completions`, the latter with vLLM-shaped token
ids: `prompt_token_ids` on the first chunk, `token_ids` on every chunk)."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
import zlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from agent_server import toy_tokens
from agent_server.config import DEFAULT_LOCAL_MODEL
from agent_server.loopback_http import HttpRequest, HttpResponse, LoopbackHttpServer
from agent_server.provider import may_hold_lone_surrogates, without_lone_surrogates
from trace_reducer import LOGPROBS_INCLUDE

_Send = Callable[..., Awaitable[None]]


def numbered_events(response: HttpResponse) -> _Send:
    """send(event_type, **fields): one Responses API SSE event on response, numbered in
    `sequence_number` from 1 as the API numbers them."""
    sequence = 0

    async def send(event_type: str, **fields: Any) -> None:
        nonlocal sequence
        sequence += 1
        await response.event(
            {"type": event_type, "sequence_number": sequence, **fields}, event=event_type
        )

    return send


_QUOTE_WORDS = 12
_QUOTE_CHARS = 200
_CLOSING = (
    "This reply comes from the built-in local model, which runs offline on loopback.",
    "It streams one word at a time over the same Server-Sent Events protocol as the "
    "Responses API, so the real client code path runs.",
    "Every word you see was recorded in the trace bundle before it reached you.",
    "Interrupt the turn at any moment and the items already finished stay accepted.",
    "Close the thread to finish the recording, then reduce the bundle to see what happened.",
)


def last_user_text(input_items: Any) -> str:
    """The text of the last user message of a Responses API `input` array ('' when none)."""
    if not isinstance(input_items, list):
        return ""
    for item in reversed(input_items):
        if not isinstance(item, dict) or item.get("role") != "user":
            continue
        return toy_tokens.content_text(item.get("content"))
    return ""


def tool_calls_for(tools: Any, input_items: Any, tool_choice: Any = None) -> list[tuple[str, str]]:
    """The calls (name, JSON arguments) the local model makes: one per declared function tool
    that the last user message names, in the order named; none right after tool outputs.
    `tool_choice` is obeyed: `none` calls nothing, `required` calls the first tool when the
    message names none, a named function is called alone.

    The arguments fill the tool's first string parameter with the user's text."""
    if not isinstance(tools, list) or not isinstance(input_items, list) or not input_items:
        return []
    last = input_items[-1]
    if not isinstance(last, dict) or last.get("role") != "user" or tool_choice == "none":
        return []
    declared = [
        tool
        for tool in tools
        if isinstance(tool, dict)
        and tool.get("type") == "function"
        and isinstance(tool.get("name"), str)
    ]
    text = last_user_text(input_items)
    if isinstance(tool_choice, dict):
        wanted = [tool for tool in declared if tool["name"] == tool_choice.get("name")]
        return [(t["name"], json.dumps(_arguments(t.get("parameters"), text))) for t in wanted]
    calls = _named_calls(declared, text)
    if not calls and tool_choice == "required" and declared:
        first = declared[0]
        calls = [(first["name"], json.dumps(_arguments(first.get("parameters"), text)))]
    return calls


def _named_calls(tools: list[dict[str, Any]], text: str) -> list[tuple[str, str]]:
    named: list[tuple[int, str, Any]] = []
    for tool in tools:
        name = tool["name"]
        match = re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)
        if match:
            named.append((match.start(), name, tool.get("parameters")))
    return [
        (name, json.dumps(_arguments(parameters, text))) for _, name, parameters in sorted(named)
    ]


def _arguments(parameters: Any, text: str) -> dict[str, Any]:
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if isinstance(properties, dict):
        for key, schema in properties.items():
            if isinstance(schema, dict) and schema.get("type") == "string":
                return {key: text}
    return {}


def reply_words_for(input_items: Any) -> list[str]:
    """The reply to a request: to the user's last message, or quoting the tool outputs that
    answered the calls of the previous response."""
    outputs = _trailing_tool_outputs(input_items)
    if not outputs:
        return reply_words(last_user_text(input_items))
    text = " ".join(f'The tool {name} returned: "{output}".' for name, output in outputs)
    words = text.split(" ")
    return [word if i == 0 else " " + word for i, word in enumerate(words)]


def _trailing_tool_outputs(input_items: Any) -> list[tuple[str, str]]:
    """(tool name, output) of the function_call_output items that end the input."""
    if not isinstance(input_items, list):
        return []
    # A call id is looked up only when it is a string: a client may put a list or an object
    # there (a Chat `tool_call_id`), which no dict key can be (was: TypeError, HTTP 500).
    names = {
        item["call_id"]: item.get("name")
        for item in input_items
        if isinstance(item, dict)
        and item.get("type") == "function_call"
        and isinstance(item.get("call_id"), str)
    }
    outputs: list[tuple[str, str]] = []
    for item in reversed(input_items):
        if not isinstance(item, dict) or item.get("type") != "function_call_output":
            break
        call_id = item.get("call_id")
        name = names.get(call_id, "?") if isinstance(call_id, str) else "?"
        outputs.append((str(name), str(item.get("output"))[:_QUOTE_CHARS]))
    return outputs[::-1]


def reply_words(user_text: str) -> list[str]:
    """The deterministic reply to `user_text`, split into the deltas it is streamed as."""
    words = user_text.split()
    quote = " ".join(words[:_QUOTE_WORDS]) + (" ..." if len(words) > _QUOTE_WORDS else "")
    opening = f'You said: "{quote}".' if quote else "You said nothing."
    text_words = " ".join((opening, *_CLOSING)).split(" ")
    return [word if i == 0 else " " + word for i, word in enumerate(text_words)]


class LocalModel:
    """Serves POST /responses with `stream: true` on 127.0.0.1, like the Responses API."""

    def __init__(self, word_delay: float, *, full_protocol: bool = False) -> None:
        self._word_delay = word_delay
        # The whole protocol (content parts, `.done` events, the output repeated in
        # response.completed, non-streamed answers), as the real API speaks it to clients that
        # rely on it (behind the gateway); the agent server needs none of it.
        self._full = full_protocol
        self._http: LoopbackHttpServer | None = None

    @classmethod
    async def start(
        cls, word_delay: float, port: int = 0, *, full_protocol: bool = False
    ) -> LocalModel:
        model = cls(word_delay, full_protocol=full_protocol)
        model._http = await LoopbackHttpServer.start(model._handle, port=port)
        return model

    @property
    def url(self) -> str:
        assert self._http is not None
        return self._http.url

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()

    async def _handle(self, request: HttpRequest, response: HttpResponse) -> None:
        route = request.path.rstrip("/").split("?")[0]
        if request.method == "GET" and route == "/models":
            # What an SDK's models.list() asks first (the gateway forwards it).
            await response.send(200, _MODELS)
            return
        if request.method != "POST" or route not in ("/responses", "/chat/completions"):
            await _error(
                response, 404, "not_found", f"no route for {request.method} {request.path}"
            )
            return
        try:
            body = request.json()
        except (ValueError, RecursionError):
            await _error(response, 400, "invalid_json", "the request body is not valid JSON")
            return
        if isinstance(body, dict) and may_hold_lone_surrogates(request.body):
            # JSON's `\ud800` escapes (and surrogates encoded as bytes, which json reads with
            # surrogatepass) make strings UTF-8 cannot carry; the replies echo the user's text
            # and hash it into toy tokens, both by way of UTF-8. U+FFFD stands in for each, as
            # everywhere else in the product (the provider's events, the reduced state).
            body = without_lone_surrogates(body)
            if body is None:
                await _error(
                    response, 400, "invalid_request", "the request body is nested too deep"
                )
                return
        whole = isinstance(body, dict) and self._full and not body.get("stream")
        if isinstance(body, dict) and self._full and isinstance(body.get("input"), str):
            # The API's short form: one user message.
            body["input"] = [{"role": "user", "content": body["input"]}]
        if not isinstance(body, dict) or (body.get("stream") is not True and not whole):
            await _error(response, 400, "invalid_request", "only `stream: true` is supported")
            return
        chat = route == "/chat/completions"
        if chat:
            body = _responses_body(body)
            # A whole answer always counts its tokens (OpenAI's and vLLM's do); a stream only
            # when `stream_options.include_usage` asks, in a last chunk of no choices.
            body["usage"] = body["usage"] or whole
        # The local model's idea of tokens: its toy tokenizer's, on the prompt it renders.
        prompt = toy_tokens.render_prompt(body.get("instructions"), body.get("input"))
        sampler = _Sampler.for_request(body, len(prompt), request.headers.get(_CALL_HEADER, ""))
        if chat:
            target = _ChatCollector(response) if whole else response
            await _ChatStream(target, body, prompt, sampler, self._word_delay).run()
            if whole:
                assert isinstance(target, _ChatCollector)
                await target.answer()
            return
        if whole:
            await self._answer_whole(response, body, prompt, sampler)
            return
        send = numbered_events(response)
        await response.start()
        await self._stream(_full_protocol(send) if self._full else send, body, prompt, sampler)

    async def _answer_whole(
        self, response: HttpResponse, body: dict[str, Any], prompt: list[int], sampler: _Sampler
    ) -> None:
        """A non-streamed answer: the response object the stream's last event carries."""
        final: dict[str, Any] = {}

        async def keep(event_type: str, **fields: Any) -> None:
            if isinstance(fields.get("response"), dict):
                final.update(fields["response"])

        await self._stream(_full_protocol(keep), body, prompt, sampler)
        await response.send(200, json.dumps(final).encode())

    async def _stream(
        self, send: _Send, body: dict[str, Any], prompt: list[int], sampler: _Sampler
    ) -> None:
        model = str(body.get("model", ""))
        response_id = f"resp_{uuid.uuid4().hex}"
        envelope = {"id": response_id, "object": "response", "model": model}
        created: dict[str, Any] = {**envelope, "status": "in_progress"}
        if sampler.token_ids:
            # vLLM's extension: the prompt as the engine tokenized it.
            created["prompt_token_ids"] = prompt
        await send("response.created", response=created)
        input_items = body.get("input")
        calls = tool_calls_for(body.get("tools"), input_items, body.get("tool_choice"))
        if calls:
            await self._send_calls(send, calls, sampler)
        else:
            words = reply_words_for(input_items)
            if sampler.variant:
                words.append(f" (Sample {sampler.variant}.)")
            await self._send_message(send, words, sampler)
        usage = {
            "input_tokens": len(prompt),
            "output_tokens": sampler.count,
            "total_tokens": len(prompt) + sampler.count,
        }
        if sampler.exhausted:
            await send(
                "response.incomplete",
                response={
                    **envelope,
                    "status": "incomplete",
                    "incomplete_details": {"reason": "max_output_tokens"},
                    "usage": usage,
                },
            )
            return
        # Only the events the agent needs: the real API's content_part and *.done events, and
        # the output repeated in response.completed, would each record the whole text again.
        await send(
            "response.completed", response={**envelope, "status": "completed", "usage": usage}
        )

    async def _send_message(self, send: _Send, deltas: list[str], sampler: _Sampler) -> None:
        item_id = f"msg_{uuid.uuid4().hex}"
        item = {"id": item_id, "type": "message", "role": "assistant"}
        await send(
            "response.output_item.added",
            output_index=0,
            item={**item, "status": "in_progress", "content": []},
        )
        sent = []
        for position, delta in enumerate(deltas):
            text, fields = sampler.sample(
                delta, first=position == 0, last=position == len(deltas) - 1
            )
            if text or fields:
                sent.append(text)
                await send(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=0,
                    content_index=0,
                    delta=text,
                    **fields,
                )
            if sampler.exhausted:
                break
            if self._word_delay:
                await asyncio.sleep(self._word_delay)
        part = {"type": "output_text", "text": "".join(sent), "annotations": []}
        status = "incomplete" if sampler.exhausted else "completed"
        done_item = {**item, "status": status, "content": [part]}
        await send("response.output_item.done", output_index=0, item=done_item)

    async def _send_calls(
        self, send: _Send, calls: list[tuple[str, str]], sampler: _Sampler
    ) -> None:
        """One function_call item per (name, arguments), its arguments streamed in pieces."""
        for index, (name, arguments) in enumerate(calls):
            item = {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "function_call",
                "call_id": f"call_{uuid.uuid4().hex[:24]}",
                "name": name,
            }
            await send(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            # Whole words a delta, so that each delta's tokens are the tokens of its text.
            words = toy_tokens.pieces(arguments) if sampler.tokens else []
            chunks = _chunks(arguments, words)
            for position, chunk in enumerate(chunks):
                # A call's tokens render `call NAME` and its arguments: the first delta carries
                # the tokens of `call NAME` too (no text of the item has them).
                text, fields = sampler.sample(
                    chunk,
                    first=position == 0,
                    last=position == len(chunks) - 1,
                    new_item=index > 0,
                    opening=toy_tokens.call_opening(name) if position == 0 else None,
                )
                await send(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=text,
                    **fields,
                )
                if self._word_delay:
                    await asyncio.sleep(self._word_delay)
            await send(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=arguments,
            )
            done = {**item, "arguments": arguments, "status": "completed"}
            await send("response.output_item.done", output_index=index, item=done)


_CALL_HEADER = "x-rollout-inference-call-id"
# GET /models: the one model (it answers to any name; this is the server's default).
_MODELS = json.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": DEFAULT_LOCAL_MODEL,
                "object": "model",
                "created": 0,
                "owned_by": "rollout-trace",
            }
        ],
    }
).encode()


def _full_protocol(send: _Send) -> _Send:
    """send, with the events and fields the agent server does without: a message's content
    part added and done around its deltas, its text's `.done`, and the output items repeated
    in the terminal event's response."""
    output: list[Any] = []
    texts: dict[int, list[str]] = {}

    async def full(event_type: str, **fields: Any) -> None:
        item = fields.get("item")
        index = fields.get("output_index", 0)
        is_message = isinstance(item, dict) and item.get("type") == "message"
        if event_type == "response.output_item.done" and is_message:
            assert isinstance(item, dict)
            text = "".join(texts.pop(index, []))
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            part = {"type": "output_text", "text": text, "annotations": []}
            await send("response.output_text.done", **where, text=text)
            await send("response.content_part.done", **where, part=part)
        if event_type == "response.output_text.delta":
            texts.setdefault(index, []).append(fields.get("delta", ""))
        if event_type == "response.output_item.done":
            output.append(item)
        if event_type in ("response.completed", "response.incomplete"):
            fields["response"] = {**fields["response"], "output": list(output)}
        await send(event_type, **fields)
        if event_type == "response.output_item.added" and is_message:
            assert isinstance(item, dict)
            part = {"type": "output_text", "text": "", "annotations": []}
            await send(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )

    return full


def _chunks(arguments: str, words: list[str]) -> list[str]:
    """arguments in about three deltas (at token boundaries when tokens are sent)."""
    if not words:
        step = max(1, len(arguments) // 3)
        return [arguments[i : i + step] for i in range(0, len(arguments), step)] or [""]
    per = max(1, len(words) // 3)
    return ["".join(words[i : i + per]) for i in range(0, len(words), per)]


class _Sampler:
    """The local model's sampling of one response: tokens of each delta, their logprobs and
    ids when the request asked, and the max_output_tokens budget."""

    def __init__(
        self, *, logprobs: bool, top: int, token_ids: bool, limit: int | None, position: int
    ) -> None:
        self.logprobs = logprobs
        self.top = top
        self.token_ids = token_ids
        self.limit = limit
        self.position = position
        self.count = 0
        self.exhausted = False
        self.variant = 0

    @property
    def tokens(self) -> bool:
        return self.logprobs or self.token_ids

    @classmethod
    def for_request(cls, body: dict[str, Any], position: int, call_id: str) -> _Sampler:
        include = body.get("include")
        top = body.get("top_logprobs")
        top = top if isinstance(top, int) and not isinstance(top, bool) and 0 < top <= 20 else 0
        limit = body.get("max_output_tokens")
        limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
        sampler = cls(
            logprobs=(isinstance(include, list) and LOGPROBS_INCLUDE in include) or top > 0,
            top=top,
            token_ids=body.get("return_token_ids") is True,
            limit=limit,
            position=position,
        )
        temperature = body.get("temperature")
        if isinstance(temperature, int | float) and temperature > 0 and call_id:
            # Samples at a temperature differ from call to call, deterministically.
            sampler.variant = 1 + zlib.crc32(call_id.encode())
        return sampler

    def sample(
        self,
        text: str,
        *,
        first: bool,
        last: bool,
        new_item: bool = False,
        opening: list[str] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """The text to send for this delta (cut at the budget) and its token fields.

        Tokens: an item's header when it is not the response's first (the prompt ended with
        the first one's), then `opening` (token strings with no text in the item), the
        delta's own pieces, and <end> after an item's last delta."""
        tokens: list[tuple[int, str, bool]] = []
        if first and new_item:
            role_texts = toy_tokens.header_texts("assistant")
            ids = toy_tokens.header("assistant")
            tokens += [(i, t, False) for i, t in zip(ids, role_texts, strict=True)]
        for piece in opening or ():
            tokens.append((toy_tokens.piece_id(piece), piece, False))
        tokens += [(toy_tokens.piece_id(p), p, True) for p in toy_tokens.pieces(text)]
        if last:
            tokens.append((toy_tokens.END, toy_tokens.END_TEXT, False))
        if self.limit is not None and self.count + len(tokens) > self.limit:
            tokens = tokens[: max(0, self.limit - self.count)]
            text = "".join(t for _, t, is_text in tokens if is_text)
            self.exhausted = True
        ids = [token[0] for token in tokens]
        fields: dict[str, Any] = {}
        if self.token_ids:
            fields["token_ids"] = ids
        if self.logprobs:
            fields["logprobs"] = toy_tokens.logprob_entries(
                ids, [token[1] for token in tokens], self.position + self.count, self.top
            )
        self.count += len(ids)
        return text, fields


def _responses_body(chat: dict[str, Any]) -> dict[str, Any]:
    """A Chat Completions request as the Responses request the model's logic reads."""
    messages = chat.get("messages")
    instructions = ""
    items: list[dict[str, Any]] = []
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        text = toy_tokens.content_text(message.get("content"))
        if role in ("system", "developer") and not items and not instructions:
            instructions = text
        elif role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message.get("tool_call_id"),
                    "output": text,
                }
            )
        elif role == "assistant":
            if text:
                items.append(
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": text}],
                    }
                )
            calls = message.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    items.append(
                        {
                            "type": "function_call",
                            "call_id": call.get("id"),
                            "name": function.get("name"),
                            "arguments": function.get("arguments"),
                        }
                    )
        else:
            items.append(
                {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}
            )
    tools = chat.get("tools")
    choice = chat.get("tool_choice")
    if isinstance(choice, dict):
        function = choice.get("function")
        choice = {
            "type": "function",
            "name": function.get("name") if isinstance(function, dict) else None,
        }
    return {
        "model": chat.get("model"),
        "stream": True,
        "instructions": instructions,
        "input": items,
        "tools": [
            {"type": "function", **tool["function"]}
            for tool in (tools if isinstance(tools, list) else [])
            if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
        ],
        "tool_choice": choice,
        "include": [LOGPROBS_INCLUDE] if chat.get("logprobs") is True else [],
        "top_logprobs": chat.get("top_logprobs"),
        "max_output_tokens": chat.get("max_completion_tokens", chat.get("max_tokens")),
        "return_token_ids": chat.get("return_token_ids"),
        "temperature": chat.get("temperature"),
        "usage": _include_usage(chat.get("stream_options")),
    }


def _include_usage(options: Any) -> bool:
    # Whatever shape a client sends (a string, a list) is no request for usage, not a 500.
    return isinstance(options, dict) and options.get("include_usage") is True


class _ChunkSink(Protocol):
    """Where a chat stream's chunks go: the HTTP response, or a collector of them."""

    async def start(self) -> None: ...

    async def event(self, data: Mapping[str, Any] | str) -> None: ...


class _ChatStream:
    """One streamed chat completion, shaped as vLLM streams it."""

    def __init__(
        self,
        response: _ChunkSink,
        body: dict[str, Any],
        prompt: list[int],
        sampler: _Sampler,
        word_delay: float,
    ) -> None:
        self._response = response
        self._body = body
        self._prompt = prompt
        self._sampler = sampler
        self._delay = word_delay
        self._id = f"chatcmpl-{uuid.uuid4().hex}"
        self._model = str(body.get("model", ""))

    async def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> None:
        chunk: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": 0,
            "model": self._model,
            "choices": [] if choice is None else [{"index": 0, "logprobs": None, **choice}],
            **extra,
        }
        await self._response.event(chunk)

    def _tokens(self, fields: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "token_ids" in fields:
            out["token_ids"] = fields["token_ids"]
        if "logprobs" in fields:
            out["logprobs"] = {"content": fields["logprobs"]}
        return out

    async def run(self) -> None:
        body, sampler = self._body, self._sampler
        await self._response.start()
        first: dict[str, Any] = {}
        if sampler.token_ids:
            first["prompt_token_ids"] = self._prompt
        await self._chunk(
            {"delta": {"role": "assistant", "content": ""}, "finish_reason": None}, **first
        )
        input_items = body.get("input")
        calls = tool_calls_for(body.get("tools"), input_items, body.get("tool_choice"))
        if calls:
            await self._calls(calls)
            finish = "tool_calls"
        else:
            words = reply_words_for(input_items)
            if sampler.variant:
                words.append(f" (Sample {sampler.variant}.)")
            await self._message(words)
            finish = "stop"
        if sampler.exhausted:
            finish = "length"
        await self._chunk({"delta": {}, "finish_reason": finish})
        if body.get("usage"):
            count = len(self._prompt)
            usage = {
                "prompt_tokens": count,
                "completion_tokens": sampler.count,
                "total_tokens": count + sampler.count,
            }
            await self._chunk(None, usage=usage)
        await self._response.event("[DONE]")

    async def _message(self, deltas: list[str]) -> None:
        for position, delta in enumerate(deltas):
            text, fields = self._sampler.sample(
                delta, first=position == 0, last=position == len(deltas) - 1
            )
            if text or fields:
                await self._chunk(
                    {"delta": {"content": text}, "finish_reason": None, **self._tokens(fields)}
                )
            if self._sampler.exhausted:
                return
            if self._delay:
                await asyncio.sleep(self._delay)

    async def _calls(self, calls: list[tuple[str, str]]) -> None:
        sampler = self._sampler
        for index, (name, arguments) in enumerate(calls):
            words = toy_tokens.pieces(arguments) if sampler.tokens else []
            chunks = _chunks(arguments, words)
            for position, piece in enumerate(chunks):
                text, fields = sampler.sample(
                    piece,
                    first=position == 0,
                    last=position == len(chunks) - 1,
                    new_item=index > 0,
                    opening=toy_tokens.call_opening(name) if position == 0 else None,
                )
                call: dict[str, Any] = {"index": index, "function": {"arguments": text}}
                if position == 0:
                    call.update(id=f"call_{uuid.uuid4().hex[:24]}", type="function")
                    call["function"]["name"] = name
                await self._chunk(
                    {"delta": {"tool_calls": [call]}, "finish_reason": None, **self._tokens(fields)}
                )
                if sampler.exhausted:
                    return
                if self._delay:
                    await asyncio.sleep(self._delay)


class _ChatCollector:
    """Takes a chat stream's chunks in place of the HTTP response and answers with the whole
    `chat.completion` they add up to (a non-streamed request)."""

    def __init__(self, response: HttpResponse) -> None:
        self._response = response
        self._first: dict[str, Any] = {}
        self._content: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish: Any = None
        self._usage: Any = None
        # vLLM's whole answer carries the ids too: the prompt's, and the choice's output.
        self._token_ids: list[int] = []
        self._logprobs: list[Any] = []

    async def start(self) -> None:
        return None

    async def event(self, data: Mapping[str, Any] | str) -> None:
        if not isinstance(data, dict):
            return  # [DONE]
        self._first = self._first or data
        if data.get("usage"):
            self._usage = data["usage"]
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self._content.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                held = self._calls.setdefault(
                    call["index"], {"type": "function", "function": {"name": "", "arguments": ""}}
                )
                if "id" in call:
                    held["id"] = call["id"]
                function = call.get("function") or {}
                held["function"]["name"] += function.get("name", "")
                held["function"]["arguments"] += function.get("arguments", "")
            self._finish = choice.get("finish_reason") or self._finish
            self._token_ids.extend(choice.get("token_ids") or [])
            self._logprobs.extend((choice.get("logprobs") or {}).get("content") or [])

    async def answer(self) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._content) or None}
        if self._calls:
            message["tool_calls"] = [self._calls[index] for index in sorted(self._calls)]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": self._finish,
            "logprobs": {"content": self._logprobs} if self._logprobs else None,
        }
        whole: dict[str, Any] = {
            "id": self._first.get("id", ""),
            "object": "chat.completion",
            "created": 0,
            "model": self._first.get("model", ""),
            "choices": [choice],
        }
        if "prompt_token_ids" in self._first:
            whole["prompt_token_ids"] = self._first["prompt_token_ids"]
            choice["token_ids"] = self._token_ids
        if self._usage is not None:
            whole["usage"] = self._usage
        await self._response.send(200, json.dumps(whole).encode())


async def _error(response: HttpResponse, status: int, code: str, message: str) -> None:
    body = json.dumps(
        {"error": {"code": code, "message": message, "type": "invalid_request_error"}}
    )
    await response.send(status, body.encode())
