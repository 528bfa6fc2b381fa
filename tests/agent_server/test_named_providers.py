"""Named providers: `[providers.NAME]` tables of the config file, and threads routed to them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import grpc
import pytest

from agent_server import config
from agent_server.config import ConfigError, ProviderSettings, Secret
from rollout.agent.v1 import agent_pb2
from tests.agent_server.conftest import StartAgent, error_reason
from tests.agent_server.scripted_provider import ScriptedProvider


def load(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> config.Settings:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    return config.from_args(parser.parse_args(["--config", str(path)]), env or {})


def test_the_config_file_names_providers_with_their_api_model_key_and_capabilities(
    tmp_path: Path,
) -> None:
    settings = load(
        tmp_path,
        """
provider-api = "chat"
[providers.vllm]
url = "http://127.0.0.1:8000/v1/"
api = "chat"
model = "smollm2"
key-env = "VLLM_KEY"
[providers.plain]
url = "https://api.example/v1"
capabilities = []
""",
        {"VLLM_KEY": "sk-vllm"},
    )
    assert settings.provider_api == "chat"
    vllm, plain = settings.providers
    assert (vllm.name, vllm.url, vllm.api, vllm.model) == (
        "vllm",
        "http://127.0.0.1:8000/v1",
        "chat",
        "smollm2",
    )
    assert vllm.api_key == Secret("sk-vllm")
    assert vllm.capabilities == ("token-ids", "logprobs")
    assert (plain.api, plain.model, plain.capabilities, plain.api_key) == (
        "responses",
        None,
        (),
        None,
    )


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('[providers.x]\napi = "chat"\n', "[providers.x] needs a url"),
        ('[providers.x]\nurl = "ftp://h"\n', "url must be an http:// or https:// URL"),
        ('[providers.x]\nurl = "http://h"\napi = "grpc"\n', "api must be one of responses, chat"),
        ('[providers.x]\nurl = "http://h"\nport = 1\n', "unknown setting 'port'"),
        ('[providers.x]\nurl = "http://h"\ncapabilities = ["vision"]\n', "unknown vision"),
        ('[providers."a b"]\nurl = "http://h"\n', "a name is 1 to 64"),
        ("providers = 3\n", "providers must be tables"),
    ],
)
def test_a_bad_provider_table_is_one_clear_message(
    tmp_path: Path, table: str, message: str
) -> None:
    with pytest.raises(ConfigError, match="providers") as raised:
        load(tmp_path, table)
    assert message in str(raised.value)


async def test_threads_go_to_the_provider_they_name(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    other = await ScriptedProvider().start()
    try:
        named = ProviderSettings(
            name="other", url=other.url, api="chat", model="other-model", capabilities=()
        )
        agent = await start_agent(providers=(named,))
        chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "from other"}}]}
        end = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        other.queue(f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(end)}\n\ndata: [DONE]\n\n")
        thread = await agent.start_thread(provider="other", request_token_ids=True)
        assert (thread.provider, thread.provider_api, thread.model) == (
            "other",
            "chat",
            "other-model",
        )
        assert thread.provider_url == other.url
        events = agent.events(thread.id)
        turn = await agent.start_turn(thread.id, "hi")
        done = await events.turn_completed(turn.id)
        assert done.status == agent_pb2.TURN_STATUS_COMPLETED
        [request] = other.requests
        assert request.path.endswith("/chat/completions")
        body = json.loads(request.body)
        assert body["model"] == "other-model"
        # Its capabilities offer no token ids: a best-effort thread never asks it for them.
        assert "return_token_ids" not in body
        assert not provider.requests
        default = await agent.start_thread()
        assert (default.provider, default.provider_api) == ("", "responses")

        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await agent.start_thread(provider="nowhere")
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_reason(raised.value) == "UNKNOWN_PROVIDER"
        assert "other" in (raised.value.details() or "")
    finally:
        await other.stop()
