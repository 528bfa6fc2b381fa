"""The documented public surface, pinned: what issue 19's restructure (and any later one) keeps.

Every name in `trace_reducer.__all__`, `trace_reducer.cli.main`, `python -m trace_reducer.cli`,
the console scripts, every command of both CLIs with its flags, and the exit codes of the
documented outcomes. A surface may grow; nothing listed here may disappear or change meaning.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

import agent_server.cli
import trace_reducer
import trace_reducer.cli

REDUCER_NAMES = [
    "FORMAT_VERSION", "LOGPROBS_INCLUDE", "MAX_RECORD_BYTES", "REWARDS_FILE_NAME", "RL_FORMATS",
    "STATE_FILE_NAME", "TRACE_FILE_NAME", "VIEW_FILE_NAME", "BundleError", "BundleNotFoundError",
    "BundleReader", "BundleWriter", "CorruptBundleError", "ExportConfigError", "ExportError",
    "ExportFailedError", "Exported", "ExportedBundle", "FrameDecoder", "NotABundleError",
    "RecordBuilder", "RecordOutOfRangeError", "RecordSink", "RecordTooLargeError",
    "RecordingError", "Reducer", "ReductionError", "RequestNotFoundError", "RewardError",
    "RewardInput", "WatchUpdate", "__version__", "append_reward", "attach_rewards",
    "build_sample", "canonical_json", "check_reward", "classify_stop", "decode_varint",
    "delta_tokens", "describe_integrity", "describe_os_error", "encode_record", "encode_varint",
    "expand_request_items", "export_otlp", "export_rl", "follow_bundle", "integrity_name",
    "iter_state_json", "payload_id", "read_bundle", "read_rewards", "replay_bundle",
    "request_body", "require_reducible", "resolve_trace_file", "sampling_settings",
    "state_to_json", "write_state_json", "write_view",
]  # fmt: skip

# The OTLP export's names load the optional `otel` extra on first use, never on import.
OTEL_NAMES = {"ExportConfigError", "ExportFailedError", "ExportedBundle", "export_otlp"}

# command -> the flags it takes (beyond -h/--help); "" is the program itself.
REDUCER_COMMANDS = {
    "": {"--version"},
    "reduce": {"--output", "-o", "--stdout", "--salvage", "--compact", "--parent"},
    "reduce-all": {
        "--force", "--jobs", "--live-window", "--ray", "--salvage", "--storage-option", "--tables",
    },
    "dump": {"--json"},
    "request": {"--pretty"},
    "export-otlp": {
        "--endpoint", "--protocol", "--header", "--include-content", "--salvage", "--timeout",
    },
    "reward": {"--item", "--metadata", "--name", "--source", "--turn", "--value", "--weight"},
    "export-rl": {"--format", "--out", "--parent", "--salvage"},
    "view": {"--output", "-o", "--open"},
    "watch": set(),
    "serve": {
        "--listen", "--bundle-root", "--auth-token-env", "--tls-cert", "--tls-key",
        "--max-upload-bytes",
    },
}  # fmt: skip
AGENT_COMMANDS = {
    "": {"--version"},
    "serve": {
        "--api-key-env", "--auth-token-env", "--closed-thread-retention", "--config",
        "--event-buffer", "--listen", "--local-word-delay", "--log-format", "--log-level",
        "--max-closed-threads", "--max-retries", "--max-tool-rounds", "--metrics-listen",
        "--model", "--provider-max-connections", "--provider-url", "--retry-base-delay",
        "--stream-idle-timeout", "--tls-cert", "--tls-key", "--tool-output-timeout",
        "--trace-root",
    },
    "demo": {"--local-word-delay", "--trace-root"},
    "chat": {"--address", "--auth-token-env", "--instructions", "--model", "--tls", "--tls-ca"},
    "health": {"--address", "--timeout", "--tls", "--tls-ca"},
    "gateway": {
        "--api-key-env", "--auth-token-env", "--config", "--listen", "--local-word-delay",
        "--log-format", "--log-level", "--provider-max-connections", "--session-idle-timeout",
        "--stream-idle-timeout", "--tls-cert", "--tls-key", "--token-ids", "--trace-root",
        "--upstream",
    },
}  # fmt: skip

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def _help(main: Callable[[Sequence[str]], int], argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        main([*argv, "--help"])
    assert stop.value.code == 0
    return out.getvalue()


def _commands(top_help: str) -> set[str]:
    listing = top_help.split("COMMAND\n", 2)[-1].split("\noptions:")[0]
    return {match[1] for match in re.finditer(r"^    (\S+)", listing, re.MULTILINE)}


def _flags(command_help: str) -> set[str]:
    usage_and_options = command_help.split("options:", 1)[-1]
    return set(_FLAG.findall(usage_and_options)) - {"-h", "--help"}


def test_every_documented_name_is_exported_and_importable() -> None:
    assert set(REDUCER_NAMES) <= set(trace_reducer.__all__)
    for name in trace_reducer.__all__:
        if name in OTEL_NAMES:
            continue
        assert getattr(trace_reducer, name) is not None, name
        exec(f"from trace_reducer import {name}", {})


def test_the_otlp_names_load_on_first_use_only() -> None:
    probe = (
        "import sys, trace_reducer\n"
        "assert not any(m.startswith('opentelemetry') for m in sys.modules), 'eager otel'\n"
        "assert not any(m.startswith('pyarrow') for m in sys.modules), 'eager pyarrow'\n"
        "import trace_reducer.cli\n"
        "assert not any(m.startswith('opentelemetry') for m in sys.modules), 'eager otel (cli)'\n"
        "assert not any(m.startswith('pyarrow') for m in sys.modules), 'eager pyarrow (cli)'\n"
        "trace_reducer.export_otlp\n"
        "assert 'opentelemetry.sdk.trace' in sys.modules\n"
        "from trace_reducer import ExportConfigError, ExportFailedError, ExportedBundle\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        trace_reducer.no_such_name  # noqa: B018


def test_console_scripts_point_at_the_two_mains() -> None:
    scripts = {
        point.name: point.value
        for point in importlib.metadata.entry_points(group="console_scripts")
        if point.name in {"agent-server", "trace-reducer"}
    }
    assert scripts == {
        "agent-server": "agent_server.cli:main",
        "trace-reducer": "trace_reducer.cli:main",
    }
    for value in scripts.values():
        module, _, attribute = value.partition(":")
        assert callable(getattr(importlib.import_module(module), attribute))
    assert trace_reducer.cli.main is importlib.import_module("trace_reducer.cli").main


@pytest.mark.parametrize(
    ("module", "program"),
    [
        ("trace_reducer.cli", "trace-reducer"),
        # Were: "No module named trace_reducer.__main__; 'trace_reducer' is a package and
        # cannot be directly executed", and the same of agent_server.
        ("trace_reducer", "trace-reducer"),
        ("agent_server", "agent-server"),
    ],
)
def test_python_dash_m_runs_each_cli(module: str, program: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == EXIT_OK, done.stderr
    assert done.stdout.strip() == f"{program} {trace_reducer.__version__}"


@pytest.mark.parametrize(
    ("main", "pinned"),
    [(trace_reducer.cli.main, REDUCER_COMMANDS), (agent_server.cli.main, AGENT_COMMANDS)],
    ids=["trace-reducer", "agent-server"],
)
def test_every_command_keeps_its_flags(
    main: Callable[[Sequence[str]], int], pinned: dict[str, set[str]]
) -> None:
    top = _help(main, [])
    assert set(pinned) - {""} <= _commands(top)
    for command, flags in pinned.items():
        shown = _flags(_help(main, [command] if command else []))
        assert flags <= shown, (command, flags - shown)


def test_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:
        trace_reducer.cli.main(["no-such-command"])
    assert usage.value.code == EXIT_USAGE
    with pytest.raises(SystemExit) as usage:
        trace_reducer.cli.main([])
    assert usage.value.code == EXIT_USAGE
    capsys.readouterr()
    # A path that is no bundle, or a file without a header, is bad input: one line, code 2.
    assert trace_reducer.cli.main(["reduce", str(tmp_path / "missing")]) == EXIT_USAGE
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / trace_reducer.TRACE_FILE_NAME).write_bytes(b"\x05hello")
    assert trace_reducer.cli.main(["reduce", str(bundle)]) == EXIT_USAGE
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert all(line.startswith("trace-reducer: ") for line in lines), lines


def test_docs_api_has_a_row_for_every_rpc() -> None:
    # Was: RecordReward, in the proto and the README, had no row in docs/api.md's table.
    from rollout.agent.v1 import agent_pb2

    service = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
    api = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    rows = re.findall(r"^\| `(\w+)\(", api.split("## RPCs", 1)[1].split("\n## ", 1)[0], re.M)
    assert sorted(rows) == sorted(service.methods_by_name)


def test_docs_architecture_has_a_line_per_module() -> None:
    # The README promises "a line per module"; was: thirteen had none (seven of grpc_common's,
    # the agent's workers.py and _router.py, _canonical.c, _diff_page.py, cli's _progress.py
    # and _stdout.py).
    repo = Path(__file__).resolve().parent.parent
    text = (repo / "docs" / "architecture.md").read_text()
    named = {
        name
        for row in re.findall(r"^\| ([^|]+) \|", text, re.M)
        for name in re.findall(r"`([\w/.]+)`", row)
    }
    # The gateway's modules are named in its one row, by their stems.
    gateway_row = next(row for row in text.splitlines() if row.startswith("| `gateway/` |"))
    missing = []
    for package in ("agent_server", "grpc_common", "rollout_client", "trace_reducer"):
        for path in sorted((repo / package).rglob("*")):
            if path.suffix not in (".py", ".c", ".js") or path.name == "__init__.py":
                continue
            relative = path.relative_to(repo / package).as_posix()
            if path.parent.name == "gateway" and f"`{path.stem}`" in gateway_row:
                continue
            if path.name not in named and relative not in named:
                missing.append(f"{package}/{relative}")
    assert not missing, missing
