"""grpc_common/_files.py: a file a flag names is read only when it is one, and a FIFO is never
waited on; anything else is one line saying what the path is."""

from __future__ import annotations

import concurrent.futures
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from grpc_common._files import path_kind, read_given_file


@pytest.fixture
def places(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "file").write_bytes(b"pem")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(tmp_path / "sock"))
        yield tmp_path


def read_soon(path: Path) -> bytes:
    # In a thread, so that a read that waits on a FIFO fails the test instead of hanging it.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(read_given_file, path, "--flag", limit=100).result(timeout=30)


@pytest.mark.parametrize(
    ("name", "said"),
    [
        # Was: a FIFO waited on for ever (--config, --tls-cert, health --tls-ca).
        ("fifo", "--flag: {p}/fifo is a FIFO, not a regular file"),
        ("dir", "--flag: {p}/dir is a directory, not a regular file"),
        ("dangling", "--flag: {p}/dangling is a symbolic link to nothing, not a regular file"),
        # Was: "cannot read ...: No such device or address".
        ("sock", "--flag: {p}/sock is a socket, not a regular file"),
        ("missing", "--flag: cannot read {p}/missing: No such file or directory"),
    ],
)
def test_what_is_no_file_is_named_for_what_it_is(places: Path, name: str, said: str) -> None:
    with pytest.raises(ValueError, match=r"^--flag: ") as refused:
        read_soon(places / name)
    assert str(refused.value) == said.format(p=places)


def test_a_file_a_link_to_one_and_a_pipe_are_read(places: Path) -> None:
    assert read_soon(places / "file") == b"pem"
    # A mounted secret is a symbolic link; the user named it.
    assert read_soon(places / "link") == b"pem"
    # `--config <(...)`: the shell's pipe, its writer alive, is read as it comes.
    reading, writing = os.pipe()
    try:
        os.write(writing, b"model = 'x'\n")
        os.close(writing)
        assert read_soon(Path(f"/proc/self/fd/{reading}")) == b"model = 'x'\n"
    finally:
        os.close(reading)
    assert read_given_file(places / "file", "--flag", limit=1) == b"pe"


def test_path_kind_words(places: Path) -> None:
    kinds = {name: path_kind(places / name) for name in ("file", "fifo", "dir", "dangling")}
    assert kinds == {
        "file": "a regular file",
        "fifo": "a FIFO",
        "dir": "a directory",
        "dangling": "a symbolic link to nothing",
    }
    assert path_kind(places / "missing") == "missing"
