"""`agent-server serve` with a bearer token and TLS (the shared AccessControl)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from tests.agent_server.conftest import AGENT_SERVER, clean_env, error_reason, serve
from tests.grpc_common import test_server

# The self-signed certificate fixture the shared plumbing is tested with.
certificate = test_server.certificate

TOKEN = "agent-token-4711"


async def test_serve_with_token_and_tls(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    async with serve(
        "--auth-token-env",
        "AGENT_TOKEN",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        AGENT_TOKEN=TOKEN,
    ) as served:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(served.address, credentials) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.StartThread(agent_pb2.StartThreadRequest())
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert error_reason(raised.value) == "MISSING_TOKEN"
            # A streaming call is refused the same way, before it streams anything.
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for _ in stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id="t")):
                    pass
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert error_reason(raised.value) == "MISSING_TOKEN"
            reply = await stub.StartThread(
                agent_pb2.StartThreadRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),)
            )
            assert reply.thread.id
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest()
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert served.process.returncode == 0
    assert TOKEN.encode() not in served.stderr + served.stdout


async def test_serve_refuses_a_token_variable_that_is_unset() -> None:
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER,
        "serve",
        "--auth-token-env",
        "NO_SUCH_TOKEN_VARIABLE",
        env=clean_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await process.communicate()
    assert process.returncode == 2
    assert "NO_SUCH_TOKEN_VARIABLE" in stderr.decode()
    assert "Traceback" not in stderr.decode()


async def test_a_token_with_a_trailing_newline_is_the_token() -> None:
    # Was: `export AGENT_TOKEN=$(cat tokenfile)`-style newlines made a server nobody could
    # authenticate to; the token is stripped as the API key is.
    async with (
        serve("--auth-token-env", "AGENT_TOKEN", AGENT_TOKEN=f"{TOKEN}\n") as served,
        grpc.aio.insecure_channel(served.address) as channel,
    ):
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        reply = await stub.StartThread(
            agent_pb2.StartThreadRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
        assert reply.thread.id
    assert served.process.returncode == 0


@pytest.mark.parametrize("token", [f"{TOKEN}\nsecond-line", f"{TOKEN} more", f"{TOKEN}\x00"])
async def test_a_token_no_header_can_carry_refuses_to_start(token: str) -> None:
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER,
        "serve",
        "--auth-token-env",
        "AGENT_TOKEN",
        env=clean_env(AGENT_TOKEN=token.replace("\x00", "\x01")),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode == 2
    message = stderr.decode()
    assert "the token in AGENT_TOKEN (--auth-token-env)" in message
    assert TOKEN not in message + stdout.decode()
    assert "Traceback" not in message


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--auth-token-env", "sk-S3CRETTOKEN"],
        ["gateway", "--auth-token-env", "sk-S3CRETTOKEN"],
        ["chat", "--auth-token-env", "sk-S3CRETTOKEN"],
        ["serve", "--provider-url", "http://127.0.0.1:9/v1", "--api-key-env", "sk-S3CRETKEY"],
        ["gateway", "--api-key-env", "sk-S3CRETKEY"],
    ],
)
def test_a_secret_given_for_its_variable_name_is_refused_unrepeated(
    argv: list[str], tmp_path: Path
) -> None:
    # Was: "--auth-token-env names sk-S3CRETTOKEN, which is unset or empty", and a start-up
    # warning naming the key for --api-key-env.
    if argv[0] == "gateway":
        argv = [*argv, "--trace-root", str(tmp_path)]
    result = subprocess.run(
        [AGENT_SERVER, *argv, "--listen" if argv[0] != "chat" else "--address", "127.0.0.1:0"],
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    flag = argv[argv.index("--api-key-env") if "--api-key-env" in argv else 1]
    prog = "agent-server chat" if argv[0] == "chat" else "agent-server"
    assert result.returncode == 2
    assert result.stderr == f"{prog}: {flag} takes the NAME of a variable, not its value\n"
    assert "S3CRET" not in result.stdout


@pytest.mark.parametrize("program", ["agent-server", "trace-reducer"])
def test_a_certificate_or_key_that_cannot_serve_is_refused_naming_the_file(
    program: str, certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    cert, key = certificate
    _, other_key = test_server.make_certificate(tmp_path, "other-")
    junk = tmp_path / "passwd"
    junk.write_text("root:x:0:0:root:/root:/bin/bash\n")
    argv = [str(Path(AGENT_SERVER).parent / program), "serve", "--listen", "127.0.0.1:0"]
    if program == "trace-reducer":
        argv += ["--bundle-root", str(tmp_path)]
    expected = {
        (junk, key): f"--tls-cert: {junk} holds no PEM certificate",
        (cert, junk): f"--tls-key: {junk} holds no PEM private key",
        (cert, other_key): (
            f"--tls-cert / --tls-key: {cert} and {other_key} do not load as a certificate chain "
            "and its key (key values mismatch)"
        ),
    }
    for (given_cert, given_key), message in expected.items():
        result = subprocess.run(
            [*argv, "--tls-cert", str(given_cert), "--tls-key", str(given_key)],
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        # Was: gRPC C-core log lines, then "cannot listen on 127.0.0.1:0: Failed to bind", exit 1.
        assert (result.returncode, result.stderr) == (2, f"{program}: {message}\n")
        assert "PRIVATE KEY" not in result.stderr
