"""How both programs parse their command line (grpc_common._flags.parse_command_line): a word the
command does not take is refused by that command, with its own usage and the flag it takes that
is nearest a mistyped one."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.commands import run_each

BIN = Path(sys.executable).parent

# Each command line, the usage its refusal starts with and the line that ends it.
CASES = [
    (
        ["trace-reducer", "reduce", "--salvgae", "nosuch"],
        "usage: trace-reducer reduce ",
        "trace-reducer reduce: error: unrecognized arguments: --salvgae (did you mean --salvage?)",
    ),
    (
        ["trace-reducer", "reduce-all", "nosuch", "--tabels=tables"],
        "usage: trace-reducer reduce-all ",
        "trace-reducer reduce-all: error: unrecognized arguments: --tabels=tables "
        "(did you mean --tables?)",
    ),
    (
        ["trace-reducer", "reduce", "one", "two"],
        "usage: trace-reducer reduce ",
        "trace-reducer reduce: error: unrecognized arguments: two",
    ),
    (
        ["agent-server", "serve", "--listne", "127.0.0.1:0"],
        "usage: agent-server serve ",
        "agent-server serve: error: unrecognized arguments: --listne 127.0.0.1:0 "
        "(did you mean --listen?)",
    ),
    (
        ["agent-server", "health", "--adress", "127.0.0.1:1"],
        "usage: agent-server health ",
        "agent-server health: error: unrecognized arguments: --adress 127.0.0.1:1 "
        "(did you mean --address?)",
    ),
    (
        ["agent-server", "chat", "--no-such-flag"],
        "usage: agent-server chat ",
        # No flag near it: where the flags are listed.
        "agent-server chat: error: unrecognized arguments: --no-such-flag "
        "(`agent-server chat --help` lists its flags)",
    ),
    # Before the command. Was `the following arguments are required: COMMAND`, and for
    # `--prot 1` `argument COMMAND: invalid choice: '1'`: no word of the flag.
    (
        ["trace-reducer", "--verison"],
        "usage: trace-reducer ",
        "trace-reducer: error: unrecognized arguments: --verison (did you mean --version?)",
    ),
    (
        ["agent-server", "--verison"],
        "usage: agent-server ",
        "agent-server: error: unrecognized arguments: --verison (did you mean --version?)",
    ),
    (
        ["agent-server", "--prot", "1"],
        "usage: agent-server ",
        "agent-server: error: unrecognized arguments: --prot "
        "(`agent-server COMMAND --help` lists a command's flags)",
    ),
    (
        ["trace-reducer", "--json", "list", "runs"],
        "usage: trace-reducer ",
        "trace-reducer: error: unrecognized arguments: --json (--json is a flag of list, dump: "
        "give it after the command, `trace-reducer list --json`)",
    ),
    # Was `(`agent-server COMMAND --help` lists a command's flags)`: its parser held only the
    # named command's flags, and `x` is none.
    (
        ["agent-server", "--listen", "x", "serve"],
        "usage: agent-server ",
        "agent-server: error: unrecognized arguments: --listen (--listen is a flag of serve, "
        "gateway: give it after the command, `agent-server serve --listen`)",
    ),
]


def test_a_mistyped_flag_is_refused_by_its_command_with_the_nearest_flag() -> None:
    # Was `usage: trace-reducer [-h] [--version] COMMAND ...` and `trace-reducer: error:
    # unrecognized arguments: --salvgae`: the program's usage, which names none of the
    # command's flags, and no hint which one was meant.
    results = run_each([[str(BIN / program), *rest] for (program, *rest), _, _ in CASES])
    for (argv, usage, said), result in zip(CASES, results, strict=True):
        assert result.returncode == 2, (argv, result.stderr)
        assert "Traceback" not in result.stderr
        assert result.stderr.startswith(usage), (argv, result.stderr)
        assert result.stderr.splitlines()[-1] == said, (argv, result.stderr)
        assert not result.stdout
    # An unambiguous prefix of a flag is argparse's, and no mistake.
    (version,) = run_each([[str(BIN / "trace-reducer"), "--vers"]])
    assert (version.returncode, version.stdout.split()[0]) == (0, "trace-reducer")
