"""Keepalive and connection age: settings checked, and a stream outliving its connection."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agent_server import AgentServer, Settings, config
from agent_server.config import ConfigError
from agent_server.local_model import reply_words
from grpc_common import Keepalive
from rollout_client import AgentClient


def serve_settings(*argv: str) -> Settings:
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    return config.from_args(parser.parse_args(argv), {})


def test_the_defaults_let_clients_ping_every_30_seconds() -> None:
    options = dict(Keepalive().options())
    assert options["grpc.keepalive_time_ms"] == 60_000
    assert options["grpc.http2.min_recv_ping_interval_without_data_ms"] == 30_000
    assert "grpc.max_connection_age_ms" not in options
    aged = dict(Keepalive(max_connection_age=3600).options())
    assert aged["grpc.max_connection_age_ms"] == 3_600_000
    assert aged["grpc.max_connection_age_grace_ms"] == 30_000


def test_flags_set_them_and_bad_ones_are_config_errors() -> None:
    settings = serve_settings("--keepalive-time", "15", "--max-connection-age", "600")
    assert settings.keepalive == Keepalive(time=15, max_connection_age=600)
    # Each names its flag (was: "--keepalive-time / --max-connection-age: keepalive time …").
    with pytest.raises(ConfigError, match=r"^--keepalive-time must be more than 0 seconds"):
        serve_settings("--keepalive-time", "0")
    with pytest.raises(ConfigError, match=r"^--max-connection-age must be more than 0 seconds"):
        serve_settings("--max-connection-age", "-1")


async def test_a_stream_outlives_connections_retired_by_age(tmp_path: Path) -> None:
    # Every connection is retired after 0.3 s (0.2 s more for its calls): a turn of about a
    # second crosses several, and the client resumes its stream after the last event it saw.
    server = await AgentServer.start(
        Settings(
            listen="127.0.0.1:0",
            trace_root=tmp_path,
            local_word_delay=0.05,
            keepalive=Keepalive(max_connection_age=0.3, max_connection_age_grace=0.2),
        )
    )
    prompt = "tell me something long enough to cross several connections"
    try:
        async with AgentClient(server.address) as client:
            thread = await client.start_thread()
            turn = thread.run_turn(prompt)
            indexes = [event.index async for event in turn]
            await thread.close()
    finally:
        await server.stop()
    assert turn.status_name == "COMPLETED"
    assert turn.text == "".join(reply_words(prompt))
    assert indexes == sorted(set(indexes)), "no event missed or repeated"
