"""Go, Java and C# stubs from `buf generate` on this repository, without managed mode, used.

Go: the stubs build, and a Go client streams a turn from `agent-server serve` and reads an
ErrorInfo. Java: the stubs compile, and Java decodes a real error's google.rpc.Status with the
vendored google/rpc protos. C#: the stubs are generated in their namespaces. The tools come from
the Debian packages (scripts/test-backends.sh installs them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from tests.live_server import LiveServer, live_server

ROOT = Path(__file__).resolve().parent.parent
BUF = str(ROOT / ".venv" / "bin" / "buf")
HERE = Path(__file__).resolve().parent / "other_languages"
GO_IMPORT_ROOT = "rollout-trace/gen/go"
DEBIAN_GOPATH = "/usr/share/gocode"
PROTOBUF_JAR = "/usr/share/java/protobuf.jar"

# The templates a user would write: local plugins and protoc's built-in generators only.
GO_TEMPLATE = """version: v2
plugins:
  - local: protoc-gen-go
    out: go
    opt: paths=source_relative
  - local: protoc-gen-go-grpc
    out: go
    opt: paths=source_relative
"""
JAVA_CSHARP_TEMPLATE = """version: v2
plugins:
  - protoc_builtin: java
    out: java
  - protoc_builtin: csharp
    out: csharp
"""

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for tool in ("protoc", "go", "protoc-gen-go", "protoc-gen-go-grpc", "javac"):
        assert shutil.which(tool), f"{tool} is missing: run scripts/test-backends.sh"
    out = tmp_path_factory.mktemp("stubs")
    go_template = out / "buf.gen.go.yaml"
    go_template.write_text(GO_TEMPLATE)
    other_template = out / "buf.gen.other.yaml"
    other_template.write_text(JAVA_CSHARP_TEMPLATE)
    # Go takes google.rpc from its genproto module, as Go programs do; the others generate it.
    for args in (
        ["protos", "--template", str(go_template)],
        ["--template", str(other_template)],
    ):
        subprocess.run(
            [BUF, "generate", *args, "--output", str(out)],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    return out


@pytest.fixture(scope="module")
def served() -> Iterator[LiveServer]:
    with live_server("--local-word-delay", "0") as server:
        yield server


# Compiling takes minutes on a busy machine: the guard is the compile's own timeout.
@pytest.mark.timeout(420)
def test_a_go_client_on_the_generated_stubs(
    generated: Path, served: LiveServer, tmp_path: Path
) -> None:
    gopath = tmp_path / "gopath"
    shutil.copytree(generated / "go", gopath / "src" / GO_IMPORT_ROOT)
    program = gopath / "src" / "agentclient"
    program.mkdir()
    shutil.copy(HERE / "go_client.go", program / "main.go")
    env = {
        **os.environ,
        "GO111MODULE": "off",
        "GOPATH": f"{gopath}{os.pathsep}{DEBIAN_GOPATH}",
        "GOCACHE": str(tmp_path / "gocache"),
        "GOFLAGS": "",
    }
    binary = tmp_path / "agentclient"
    built = subprocess.run(
        ["go", "build", "-o", str(binary), "."],
        cwd=program,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(binary), served.address], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.strip().splitlines()
    assert lines[0].startswith('You said: "hello from Go".')
    assert lines[-2].strip() == "TURN_STATUS_COMPLETED"
    assert lines[-1] == "NotFound THREAD_NOT_FOUND map[thread_id:nope]"


# Compiling takes minutes on a busy machine: the guard is the compile's own timeout.
@pytest.mark.timeout(420)
def test_java_decodes_a_real_error_info(
    generated: Path, served: LiveServer, tmp_path: Path
) -> None:
    # A real error's status details, as they travel in the trailer.
    with grpc.insecure_channel(served.address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.GetThread(agent_pb2.GetThreadRequest(thread_id="thread_java"))
    # The stubs type metadata entries as objects; at run time they are (key, value) pairs.
    trailers: dict[str, bytes] = dict(raised.value.trailing_metadata())  # type: ignore[arg-type]
    status_file = tmp_path / "status.bin"
    status_file.write_bytes(trailers["grpc-status-details-bin"])

    classes = tmp_path / "classes"
    sources = [str(p) for p in (generated / "java").rglob("*.java")]
    assert any(s.endswith("com/google/rpc/ErrorInfo.java") for s in sources)
    compiled = subprocess.run(
        [
            "javac",
            "-nowarn",
            "-d",
            str(classes),
            "-cp",
            PROTOBUF_JAR,
            *sources,
            str(HERE / "DecodeErrorInfo.java"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    ran = subprocess.run(
        [
            "java",
            "-cp",
            f"{classes}{os.pathsep}{PROTOBUF_JAR}",
            "DecodeErrorInfo",
            str(status_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["5 THREAD_NOT_FOUND {thread_id=thread_java}", "m"]


def test_csharp_stubs_have_their_namespaces(generated: Path) -> None:
    agent = (generated / "csharp" / "Agent.cs").read_text()
    assert "namespace Rollout.Agent.V1 {" in agent
    assert "namespace Google.Rpc {" in (generated / "csharp" / "ErrorDetails.cs").read_text()
