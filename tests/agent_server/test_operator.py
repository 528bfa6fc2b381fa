"""What an operator gets from `agent-server serve`: logs, metrics, warnings, a config file."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_server import telemetry
from agent_server.config import add_serve_arguments, from_args
from rollout.agent.v1 import agent_pb2
from rollout_client import AgentClient
from tests.agent_server.conftest import AGENT_SERVER, Harness, StartAgent, clean_env
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    answer,
    completed,
    created,
    item_added,
    item_done,
    message,
    sse,
    text_delta,
)
from tests.docs import block

METRICS_LINE = re.compile(r"metrics at (http://\S+/metrics)")


@dataclass
class Operated:
    process: asyncio.subprocess.Process
    address: str
    # The log lines read so far; all of them once the process has ended.
    log: list[str] = field(default_factory=list)

    async def metrics_url(self) -> str:
        """The endpoint the server logged (before `listening on`, so already in the pipe)."""
        assert self.process.stderr is not None
        while True:
            for line in self.log:
                found = METRICS_LINE.search(line)
                if found:
                    return found.group(1)
            line = (await self.process.stderr.readline()).decode()
            assert line, f"no metrics line in {self.log}"
            self.log.append(line.rstrip("\n"))


@contextlib.asynccontextmanager
async def operate(*args: str, **env: str) -> AsyncIterator[Operated]:
    """`agent-server serve` whose log can be read as it is written; SIGTERM at the end."""
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER,
        "serve",
        "--listen",
        "127.0.0.1:0",
        *args,
        env=clean_env(**env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    line = (await process.stdout.readline()).decode()
    assert line.startswith("listening on "), (line, await process.stderr.read())
    operated = Operated(process, line.removeprefix("listening on ").strip())
    try:
        yield operated
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        _, rest = await process.communicate()
        operated.log += rest.decode().splitlines()
        assert process.returncode == 0, operated.log


async def until(condition: Callable[[], Awaitable[bool]], seconds: float = 30) -> None:
    """Poll condition until it holds (the server notices a cancelled stream in its own time)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


def scrape(url: str) -> dict[str, float]:
    """Every sample of the endpoint, keyed `name{label="value",...}` (labels sorted)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


async def test_metrics_are_scraped_and_add_up(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    async with operate(
        "--metrics-listen",
        "127.0.0.1:0",
        "--trace-root",
        str(traces),
        "--local-word-delay",
        "0.01",
    ) as served:
        url = await served.metrics_url()
        before = await asyncio.to_thread(scrape, url)
        assert before["rollout_agent_threads_active"] == 0
        async with AgentClient(served.address) as client:
            thread = await client.start_thread()
            assert (await thread.run_turn("count me").wait()).status == (
                agent_pb2.TURN_STATUS_COMPLETED
            )
            second = thread.run_turn("stop me")
            async for event in second:
                if event.HasField("agent_message_delta") and second.result is None:
                    await second.interrupt()
                    # The turn's event stream is still attached: one subscriber.
                    during = await asyncio.to_thread(scrape, url)

            async def detached() -> bool:
                samples = await asyncio.to_thread(scrape, url)
                return samples["rollout_agent_event_subscribers"] == 0

            await until(detached)
            running = await asyncio.to_thread(scrape, url)
            closed = await thread.close()
        after = await asyncio.to_thread(scrape, url)

    assert during["rollout_agent_event_subscribers"] == 1
    assert running["rollout_agent_threads_active"] == 1
    assert running["rollout_agent_turns_active"] == 0
    assert after["rollout_agent_threads_active"] == 0
    assert after["rollout_agent_threads_total"] == 1
    assert after['rollout_agent_turns_total{status="COMPLETED"}'] == 1
    assert after['rollout_agent_turns_total{status="INTERRUPTED"}'] == 1
    assert after['rollout_agent_provider_calls_total{http_status="200",status="COMPLETED"}'] == 1
    assert after['rollout_agent_provider_calls_total{http_status="none",status="CANCELLED"}'] == 1
    assert after["rollout_agent_time_to_first_delta_seconds_count"] == 2
    assert after["rollout_agent_turn_duration_seconds_count"] == 2
    assert after["rollout_agent_deltas_total"] >= 2
    assert after['rollout_agent_tokens_total{kind="output"}'] > 0
    assert after["rollout_agent_recording_failures_total"] == 0
    # Every byte of the bundle, counted as it was synced.
    bundle_file = Path(closed.bundle_path) / "trace.binpb"
    assert after["rollout_agent_recorded_bytes_total"] == bundle_file.stat().st_size


async def test_json_logs_have_a_line_per_milestone_and_nothing_else(tmp_path: Path) -> None:
    async with (
        operate(
            "--log-format", "json", "--trace-root", str(tmp_path), "--local-word-delay", "0"
        ) as served,
        AgentClient(served.address) as client,
    ):
        thread = await client.start_thread()
        await thread.run_turn("log me").wait()
        await thread.close()
    entries = [json.loads(line) for line in served.log if line]
    # Every line is the application's: gRPC's own diagnostics stay out.
    for entry in entries:
        assert {"time", "level", "logger", "message"} <= entry.keys()
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["time"])
    by_message = {entry["message"]: entry for entry in entries}
    started = by_message["thread started"]
    assert (started["thread"], started["bundle"]) == (thread.id, thread.bundle_path)
    assert by_message["turn started"]["thread"] == thread.id
    ended = by_message["turn ended"]
    assert ended["status"] == "COMPLETED"
    assert ended["calls"] == 1
    assert ended["output_tokens"] > 0
    assert ended["duration_s"] >= 0
    closed = by_message["thread closed"]
    assert (closed["reason"], closed["turns"], closed["recording"]) == ("closed", 1, "CLOSED")
    assert [e["message"] for e in entries][-2:] == ["shutting down", "stopped"]


async def test_text_logs_and_the_log_level() -> None:
    async with operate(
        "--log-level", "warning", "--provider-url", "http://127.0.0.1:9", OPENAI_API_KEY=""
    ) as quiet:
        pass
    # Only warnings: the two a provider URL without a model or key earns.
    assert len(quiet.log) == 2, quiet.log
    for line in quiet.log:
        assert re.match(r"\d{4}-\d\d-\d\dT[\d:.]+Z WARNING ", line), line
    assert "--provider-url is set but --model is not" in quiet.log[0]
    assert "OPENAI_API_KEY (--api-key-env) is unset or empty" in quiet.log[1]
    async with operate() as chatty:
        pass
    assert any(" INFO    agent_server: listening on " in line for line in chatty.log)
    assert not any("WARNING" in line for line in chatty.log)


def sample(name: str, **labels: str) -> float:
    """A metric's value in this process (0 before it was first counted)."""
    return telemetry.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_provider_failures_and_retries_are_logged_and_counted(
    provider: ScriptedProvider, start_agent: StartAgent, caplog: pytest.LogCaptureFixture
) -> None:
    provider.queue_error(503)
    provider.queue(answer("after one retry"))
    agent: Harness = await start_agent(max_retries=1)
    failed = {"status": "FAILED", "http_status": "503"}
    failed_before = sample("rollout_agent_provider_calls_total", **failed)
    retries_before = sample("rollout_agent_provider_retries_total")
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    with caplog.at_level(logging.INFO, logger="agent_server"):
        turn = await agent.start_turn(thread.id, "retry me")
        assert (await events.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_COMPLETED
    assert sample("rollout_agent_provider_calls_total", **failed) == failed_before + 1
    assert sample("rollout_agent_provider_retries_total") == retries_before + 1
    [failure] = [r for r in caplog.records if r.getMessage().startswith("provider call failed")]
    assert failure.levelno == logging.WARNING
    assert failure.getMessage() == "provider call failed; retrying"
    fields = failure.fields  # type: ignore[attr-defined]
    assert (fields["attempt"], fields["http_status"], fields["turn"]) == (1, 503, turn.id)
    [ended] = [r for r in caplog.records if r.getMessage() == "turn ended"]
    assert ended.fields["calls"] == 2  # type: ignore[attr-defined]


async def test_a_turn_whose_provider_reported_no_usage_logs_no_token_counts(
    provider: ScriptedProvider, agent: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    # Unknown is not 0: the turn ended line leaves the counts out, as `list` says `?`.
    item = message("nothing counted", "msg-1")
    events_sent = [created(), item_added(item), text_delta("nothing counted", "msg-1")]
    provider.queue(sse(*events_sent, item_done(item), completed()))
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    with caplog.at_level(logging.INFO, logger="agent_server"):
        turn = await agent.start_turn(thread.id, "count nothing")
        assert (await events.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_COMPLETED
    [ended] = [r for r in caplog.records if r.getMessage() == "turn ended"]
    fields = ended.fields  # type: ignore[attr-defined]
    assert fields["calls"] == 1
    assert "input_tokens" not in fields
    assert "output_tokens" not in fields


async def test_a_recording_failure_is_counted(provider: ScriptedProvider, agent: Harness) -> None:
    provider.queue(answer("unrecorded"))
    before = sample("rollout_agent_recording_failures_total")
    thread = await agent.start_thread()
    (Path(thread.bundle_path) / "trace.binpb").unlink()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "one")
    await events.turn_completed(turn.id)
    assert sample("rollout_agent_recording_failures_total") == before + 1


async def test_a_config_file_under_the_environment_and_the_flags(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        'log-format = "json"\n'
        'trace-root = "traces"\n'
        'model = "from-file"\n'
        "local-word-delay = 0\n"
        'metrics-listen = "127.0.0.1:0"\n'
    )
    async with operate(
        "--config", str(config), "--model", "from-flag", ROLLOUT_LOG_FORMAT="text"
    ) as served:
        async with AgentClient(served.address) as client:
            thread = await client.start_thread()
            await thread.close()
        await served.metrics_url()
    # The environment beat the file (text, not JSON); the flag beat the file (the model).
    assert served.log[0][:4].isdigit()
    assert thread.model == "from-flag"
    # A relative path in the file is taken from the file's directory.
    assert Path(thread.bundle_path).parent == tmp_path / "traces"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('listen = "127.0.0.1:0"\nno-such-flag = 1\n', "unknown setting 'no-such-flag'"),
        ('max-retries = "4"\n', "max-retries must be an integer, not str"),
        # The value is never repeated: a URL or key in the wrong place may be a secret.
        (
            'provider-url = ["http://u:S3CRETPW@h/v1"]\n',
            "provider-url must be a string, not a list",
        ),
        ("model = \n", "is not valid TOML"),
        # Was: a RecursionError traceback, exit 1.
        ("a = " + "[" * 100_000 + "]" * 100_000 + "\n", "is not valid TOML: nested too deeply"),
        ("[a]\nb = " + "{c = " * 5_000 + "1" + "}" * 5_000 + "\n", "nested too deeply"),
        # Was: read whole, as /dev/zero would be, however large.
        ("# " + "x" * (2 << 20) + "\n", "is larger than 1 MiB: not a settings file"),
        ('log-level = "loud"\n', "--log-level must be one of"),
    ],
)
async def test_a_bad_config_file_is_one_line_and_exit_2(
    tmp_path: Path, content: str, message: str
) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(content)
    code, stderr = await _run("serve", "--config", str(config))
    assert code == 2
    assert stderr.startswith("agent-server: ")
    assert message in stderr
    assert "S3CRET" not in stderr
    assert len(stderr.strip().splitlines()) == 1


async def test_version_and_demo_flags() -> None:
    code, stdout = await _run("--version", stream="stdout")
    assert code == 0
    assert re.fullmatch(r"agent-server \d+\.\d+\.\d+\S*\n", stdout)
    # demo has its own few flags; a server flag is an error, not silently ignored.
    code, stderr = await _run("demo", "--listen", "127.0.0.1:9999")
    assert code == 2
    assert "unrecognized arguments: --listen" in stderr


async def _run(*args: str, stream: str = "stderr") -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER,
        *args,
        env=clean_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode is not None
    text = (stdout if stream == "stdout" else stderr).decode()
    assert "Traceback" not in text
    return process.returncode, text


async def test_the_health_probe() -> None:
    async with operate() as served:
        code, stdout = await _run("health", "--address", served.address, stream="stdout")
        assert (code, stdout) == (0, "SERVING\n")
    # Nothing listens there any more.
    code, stderr = await _run("health", "--address", served.address, "--timeout", "1")
    assert code == 1
    assert stderr.startswith(f"agent-server health: no agent server answers at {served.address} (")
    assert stderr.endswith(
        "start one with `agent-server serve`, or give its address with --address"
        " or $ROLLOUT_ADDRESS\n"
    )


def test_the_documented_config_file_loads(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(block("config", "toml", doc="docs/operating.md"))
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    settings = from_args(parser.parse_args(["--config", str(config)]), {"AGENT_TOKEN": "t0ken"})
    assert settings.provider_url == "https://provider.example/v1"
    assert settings.access.token == "t0ken"
    assert settings.trace_root == tmp_path / "traces"
    assert (settings.log_format, settings.metrics_listen) == ("json", "127.0.0.1:9464")
    assert settings.warnings() == [
        "--provider-url is set but OPENAI_API_KEY (--api-key-env) is unset or empty: "
        "requests go to the provider without an API key"
    ]


def _listed(text: str, start: str, end: str) -> set[str]:
    """The `names` of the docs' text from `start` to the first `end` after it."""
    begin = text.index(start)
    return set(re.findall(r"`([^`]+)`", text[begin : text.index(end, begin)]))


def test_the_operating_guide_lists_every_config_key_and_variable() -> None:
    # Was: provider-api, providers, session-idle-timeout and gateway-listen were accepted but
    # not listed, nor ROLLOUT_PROVIDER_API.
    from agent_server import _config_file
    from tests.docs import REPO

    guide = " ".join((REPO / "docs" / "operating.md").read_text().split())
    assert _listed(guide, "Keys: ", ". ") == {*_config_file.KEYS, "providers"}
    sources = [REPO / "agent_server" / "config.py", REPO / "agent_server/gateway/_settings.py"]
    variable = re.compile(r'"(ROLLOUT_[A-Z_]+)"')
    read = {name for path in sources for name in variable.findall(path.read_text())}
    assert _listed(guide, "The environment variables are ", ". ") == read


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # Was: `agent-server health: : UNKNOWN`, exit 1.
        (["health", "--address", ""], "agent-server health: --address is empty"),
        # Was: accepted, "did not answer within -1 s", exit 1.
        (["health", "--timeout", "-1"], "agent-server health: --timeout must be"),
        (["health", "--timeout", "nan"], "agent-server health: --timeout must be"),
        (["chat", "--address", ""], "agent-server chat: --address is empty"),
        # Was: the server's default model, without a word.
        (["chat", "--model", ""], "agent-server chat: --model is empty"),
        # Was: listened on the default address without a word.
        (["serve", "--listen", ""], "agent-server: --listen is empty"),
        # Was: recording quietly off.
        (["serve", "--trace-root", ""], "agent-server: --trace-root is empty"),
        (["gateway", "--listen", "", "--trace-root", "{tmp}"], "agent-server: --listen is empty"),
        (["gateway", "--trace-root", ""], "agent-server: --trace-root is empty"),
        # Was: replayed the bundles of the current directory.
        (["serve", "--replay-from", ""], "agent-server: --replay-from is empty"),
        # Was: "--config: cannot read .: Is a directory".
        (["serve", "--config", ""], "agent-server: --config is empty"),
        # Was: "--tls-cert: cannot read .: Is a directory".
        (["serve", "--tls-cert", "", "--tls-key", "k.pem"], "agent-server: --tls-cert is empty"),
        (["serve", "--tls-cert", "c.pem", "--tls-key", ""], "agent-server: --tls-key is empty"),
        (["gateway", "--config", "", "--trace-root", "{tmp}"], "agent-server: --config is empty"),
        (
            ["gateway", "--replay-from", "", "--trace-root", "{tmp}"],
            "agent-server: --replay-from is empty",
        ),
    ],
)
def test_an_empty_address_root_or_a_bad_timeout_is_a_usage_error(
    args: list[str], message: str, tmp_path: Path
) -> None:
    result = subprocess.run(
        [AGENT_SERVER, *(arg.format(tmp=tmp_path) for arg in args)],
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        # A command that takes the empty value serves (or waits) instead: the timeout fails it.
        timeout=30,
    )
    assert result.returncode == 2
    assert result.stderr.startswith(message)
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # Was: each waited on the FIFO for ever, before any line.
        (["serve", "--config", "{fifo}"], "agent-server: --config: {fifo} is a FIFO, not a"),
        (
            ["serve", "--tls-cert", "{fifo}", "--tls-key", "{fifo}"],
            "agent-server: --tls-cert: {fifo} is a FIFO, not a regular file",
        ),
        (["health", "--tls-ca", "{fifo}"], "agent-server health: --tls-ca: {fifo} is a FIFO"),
        # Was: "--config: cannot read DIR: Is a directory".
        (["serve", "--config", "{tmp}"], "agent-server: --config: {tmp} is a directory, not a"),
    ],
)
def test_a_file_flag_naming_a_fifo_or_a_directory_says_so_at_once(
    args: list[str], message: str, tmp_path: Path
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = subprocess.run(
        [AGENT_SERVER, *(arg.format(tmp=tmp_path, fifo=fifo) for arg in args)],
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith(message.format(tmp=tmp_path, fifo=fifo)), result.stderr
    assert result.stderr.count("\n") == 1
