"""`--help` of every command of `agent-server` and `trace-reducer`: every flag explains itself and
shows its default; the docs' synopses (`<!-- usage -->` blocks) and the README's flag table name
only flags the commands have."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_server import Settings
from agent_server import cli as agent_cli
from tests.commands import run_each
from tests.docs import DOCS, REPO, Block, shell_blocks
from trace_reducer.cli import _main as reducer_cli

BIN = Path(sys.executable).parent
# What a flag's default needs no word for: off, absent, or a flag that only switches on.
_SILENT_DEFAULTS = (None, False, "", argparse.SUPPRESS)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [commands] = [
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    ]
    return dict(commands.choices)


def _agent_server(command: str | None) -> argparse.ArgumentParser:
    parser = agent_cli._parser(command)
    return parser if command is None else _subcommands(parser)[command]


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command line's parser, by its words: `agent-server serve`, `trace-reducer list`."""
    found = {"agent-server": _agent_server(None)}
    for name in _subcommands(found["agent-server"]):
        found[f"agent-server {name}"] = _agent_server(name)
    reducer = reducer_cli.build_parser()
    found["trace-reducer"] = reducer
    for name, sub in _subcommands(reducer).items():
        found[f"trace-reducer {name}"] = sub
    return found


PARSERS = parsers()


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_argument_has_help_and_shows_its_default(command: str) -> None:
    problems = []
    for action in PARSERS[command]._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.metavar or action.dest
        text = action.help or ""
        if not text.strip() or text == argparse.SUPPRESS:
            problems.append(f"{name}: no help text")
        elif (
            action.default not in _SILENT_DEFAULTS
            and action.default != []
            and action.nargs != 0
            and "default" not in text
        ):
            problems.append(f"{name}: help does not show its default {action.default!r}")
    assert not problems, f"{command}: " + "; ".join(problems)


@pytest.mark.parametrize("program", ["agent-server", "trace-reducer"])
def test_help_runs_for_every_command(program: str) -> None:
    """The installed commands print their help (each subcommand's too) and exit 0."""
    commands = ["", *(key.split(" ", 1)[1] for key in PARSERS if key.startswith(f"{program} "))]
    results = run_each([[str(BIN / program), *command.split(), "--help"] for command in commands])
    for command, shown in zip(commands, results, strict=True):
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"usage: {program} {command}".rstrip()), shown.stdout
        assert not shown.stderr


def _logical_lines(text: str) -> list[str]:
    """Shell lines with their backslash continuations joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [re.sub(r"\s#.*", "", line).strip() for line in joined.splitlines() if line.strip()]


# A flag as a synopsis writes it: `--name`, `-o`; not the `-tokens` of `--sort=-tokens`.
_FLAG = re.compile(r"(?<![\w=\-.])(--?[a-zA-Z][\w-]*)")


def _command_lines(found: Block) -> Iterator[tuple[str, str, argparse.ArgumentParser | None]]:
    """Each command line of a block: the line, its command (`trace-reducer list`) and that
    command's parser (None for a line that is no command of ours)."""
    for line in _logical_lines(found.text):
        words = line.split()
        command = " ".join(words[:2]) if len(words) > 1 and words[1][0].isalpha() else words[0]
        yield line, command, PARSERS.get(command)


def synopsis_problems(found: Block) -> list[str]:
    problems = []
    for line, command, parser in _command_lines(found):
        if parser is None:
            problems.append(f"{found.where}: {line!r} is not a command line of ours")
            continue
        unknown = sorted(set(_FLAG.findall(line)) - _options(parser))
        if unknown:
            problems.append(f"{found.where}: `{command}` has no {', '.join(unknown)}")
    return problems


def test_the_synopses_name_real_flags() -> None:
    usage = [found for found in shell_blocks() if found.kind == "usage"]
    assert len(usage) >= 10
    problems = [problem for found in usage for problem in synopsis_problems(found)]
    assert not problems, "\n".join(problems)


def _usage_block(text: str) -> Block:
    """A README usage block of text, at its first line."""
    return Block(REPO / "README.md", 1, "sh", "usage", None, text)


def test_a_wrong_flag_in_a_synopsis_is_reported() -> None:
    block = _usage_block(
        "trace-reducer list <root> [--sort=-tokens] [--colour] \\\n  [--json]  # --not-this\n"
        "agent-server --version\nagent-server nonsense --x\n"
    )
    assert synopsis_problems(block) == [
        "README.md:1: `trace-reducer list` has no --colour",
        "README.md:1: 'agent-server nonsense --x' is not a command line of ours",
    ]


def _serve_table() -> dict[str, list[str]]:
    """The README's table of `agent-server serve` settings: flag → its row's cells."""
    text = (REPO / "README.md").read_text()
    table = text.split("| flag | environment | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for row in table.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        for flag in re.findall(r"`(--[\w-]+)`", cells[0]):
            rows[flag] = cells
    return rows


def test_the_readme_table_lists_every_serve_flag() -> None:
    serve = PARSERS["agent-server serve"]
    flags = _options(serve) - {"-h", "--help"}
    table = _serve_table()
    assert set(table) == flags, (
        f"missing from the README: {sorted(flags - set(table))}; "
        f"not flags: {sorted(set(table) - flags)}"
    )
    defaults = Settings()
    for action in serve._actions:
        for flag in set(action.option_strings) & set(table):
            text = action.help or ""
            environment = table[flag][1].strip("`")
            assert environment in text, f"{flag}: its help does not name {environment}"
            shown = table[flag][2].strip("`")
            if shown not in ("off", "none"):
                assert "default" in text, f"{flag}: its help hides its default {shown}"
            default = getattr(defaults, action.dest, None)
            if isinstance(default, int | float) and not isinstance(default, bool):
                said = 0.0 if shown == "off" else float(shown)
                assert said == default, f"{flag}: the README says {shown}, not {default}"


def test_the_commands_in_the_prose_name_real_flags() -> None:
    """`agent-server …` and `trace-reducer …` written inline in the docs' text name commands
    and flags that exist, as the synopses do."""
    problems = []
    spans = 0
    for doc in DOCS:
        prose = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for span in re.findall(r"`((?:agent-server|trace-reducer)\b[^`]*)`", prose):
            spans += 1
            # A span may wrap onto the next line of the paragraph.
            found = Block(doc, 0, "sh", "usage", None, " ".join(span.split()) + "\n")
            problems += synopsis_problems(found)
    assert spans > 50
    assert not problems, "\n".join(problems)


# The words a synopsis writes for "a value goes here" (not an example value such as `2h`, nor a
# default such as `OPENAI_API_KEY`): each must be the one the flag's --help shows.
_PLACEHOLDERS = frozenset(
    {"BUNDLE", "DIR", "FILE", "HOST:PORT", "ITEM_ID", "KEY=VALUE", "MODEL", "N", "NAME", "PATH"}
    | {"PEM", "SECONDS", "SOURCE", "TEXT", "TURN_ID", "URL", "VALUE", "WEIGHT", "M", "OTHER"}
)


def placeholder_problems(found: Block) -> list[str]:
    problems = []
    for line, command, parser in _command_lines(found):
        if parser is None:
            continue
        for flag, shown in re.findall(r"(--[\w-]+)[ =]([A-Z][A-Z_:=]*)(?![\w.])", line):
            action = parser._option_string_actions.get(flag)
            if shown not in _PLACEHOLDERS or action is None:
                continue
            metavar = action.metavar or action.dest.upper()
            if metavar != shown:
                problems.append(f"{found.where}: `{command} {flag} {shown}`; --help: {metavar}")
    return problems


def test_the_synopses_name_values_as_the_help_does() -> None:
    # Was: `--tls-cert PEM` in the README, `--tls-cert PATH` in --help; `--trace-root DIR` and
    # TRACE_ROOT, `--provider-url URL` and PROVIDER_URL, `--model NAME` and MODEL, and more.
    usage = [found for found in shell_blocks() if found.kind == "usage"]
    problems = [problem for found in usage for problem in placeholder_problems(found)]
    assert not problems, "\n".join(problems)


def test_a_placeholder_the_help_does_not_use_is_reported() -> None:
    block = _usage_block("trace-reducer list <root> [--model M] [--since 2h] [--limit N]\n")
    assert placeholder_problems(block) == [
        "README.md:1: `trace-reducer list --model M`; --help: MODEL"
    ]


def test_agent_server_s_help_names_every_command() -> None:
    # Was: "`serve`, run the `demo`, `chat` with a server, probe its `health`": no gateway.
    top = PARSERS["agent-server"]
    assert top.description is not None
    named = set(re.findall(r"`([a-z]+)`", top.description))
    assert named == set(_subcommands(top))


def test_the_gateway_s_otlp_help_says_what_the_gateway_sends() -> None:
    # Was: serve's words, "each turn's spans ... as the turn ends ... needs --trace-root",
    # for a gateway that sends each call's span as the call ends and always records.
    endpoint = PARSERS["agent-server gateway"]._option_string_actions["--otlp-endpoint"]
    assert endpoint.help is not None
    assert "each call's OpenTelemetry span" in endpoint.help
    assert "--trace-root" not in endpoint.help
    serve = PARSERS["agent-server serve"]._option_string_actions["--otlp-endpoint"]
    assert serve.help is not None
    assert "needs --trace-root" in serve.help
