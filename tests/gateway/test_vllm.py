"""The unmodified `openai` SDK through `--token-ids` to a real engine (the session's vLLM, see
tests/engine.py) over Chat Completions: the engine's own ids recorded, the drift check per call,
and the ids kept from a client that did not ask for them. Greedy decoding, short answers."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from rollout.trace.v1 import common_pb2, state_pb2
from tests.engine import MODEL, READY_TIMEOUT, check_drift
from tests.gateway.conftest import StartGateway, bundles, calls, sdk
from trace_reducer import replay_bundle, request_body

pytestmark = [pytest.mark.engine, pytest.mark.timeout(READY_TIMEOUT + 600)]

SETTINGS: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 12}


async def test_engine_ids_through_the_gateway(start_gateway: StartGateway, vllm_url: str) -> None:
    gateway = await start_gateway(vllm_url, token_ids=True)
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Name one colour."}]

    # A client that did not ask: neither the whole answer nor the stream carries the ids.
    raw = await client.chat.completions.with_raw_response.create(messages=messages, **SETTINGS)
    assert "token_ids" not in raw.text
    first = raw.parse().choices[0].message.content or ""
    messages += [
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And another?"},
    ]
    stream = await client.chat.completions.create(messages=messages, stream=True, **SETTINGS)
    async for chunk in stream:
        assert "token_ids" not in json.dumps(chunk.model_dump())

    # A client that asked (its own session) gets the engine's ids, the same ones recorded.
    asked = await client.chat.completions.create(
        messages=[{"role": "user", "content": "Say hello."}],
        stream=True,
        extra_body={"return_token_ids": True},
        extra_headers={"x-rollout-session": "asked"},
        **SETTINGS,
    )
    seen_prompt: list[int] = []
    seen_output: list[int] = []
    async for chunk in asked:
        extra = chunk.model_extra or {}
        seen_prompt = seen_prompt or list(extra.get("prompt_token_ids") or [])
        for choice in chunk.choices:
            seen_output += (choice.model_extra or {}).get("token_ids") or []
    assert seen_prompt
    assert seen_output
    await gateway.stop()

    traces = {path: replay_bundle(path) for path in bundles(gateway.settings.trace_root)}
    assert len(traces) == 2
    by_calls = sorted(traces.items(), key=lambda entry: len(entry[1].inference_calls))
    (asked_bundle, asked_trace), (bundle, trace) = by_calls
    for rollout in (asked_trace, trace):
        assert rollout.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    (asked_call,) = calls(asked_trace)
    assert list(asked_call.prompt_token_ids) == seen_prompt
    assert list(asked_call.output_tokens.ids) == seen_output

    one, two = calls(trace)
    async with httpx.AsyncClient(base_url=vllm_url.removesuffix("/v1"), timeout=120) as http:
        for path, call in ((bundle, one), (bundle, two), (asked_bundle, asked_call)):
            assert call.execution.status == common_pb2.EXECUTION_STATUS_COMPLETED
            assert call.output_tokens.exact
            assert call.output_tokens.source == common_pb2.TOKEN_SOURCE_ENGINE
            assert call.output_tokens.ids
            # The prompt is what vLLM's own tokenizer makes of the messages the client sent.
            sent = json.loads(request_body(path, call.inference_call_id))
            tokenized = await http.post(
                "/tokenize",
                json={"model": MODEL, "messages": sent["messages"], "add_generation_prompt": True},
            )
            assert tokenized.status_code == 200, tokenized.text
            assert list(call.prompt_token_ids) == tokenized.json()["tokens"]

    # The drift check ran on the second call: EXACT, or exactly where it departs.
    check_drift([one, two])
