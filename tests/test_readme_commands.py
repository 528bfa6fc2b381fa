"""The README's shell recipes run as written (in bash, with the venv's commands on PATH)."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs import block

README = Path(__file__).resolve().parent.parent / "README.md"
BIN = Path(sys.executable).parent


def shell_example(name: str) -> str:
    """The sh block that follows `<!-- example: name -->` in the README."""
    return block(name, "sh")


def bash_env(**extra: str) -> dict[str, str]:
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "ROLLOUT_"))
    }
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def demo_bundle(root: Path) -> Path:
    subprocess.run(
        [BIN / "agent-server", "demo", "--trace-root", str(root), "--local-word-delay", "0"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    [bundle] = root.iterdir()
    return bundle


def test_the_tables_recipe(tmp_path: Path) -> None:
    pytest.importorskip("duckdb", reason="needs duckdb (the test dependency group)")
    demo_bundle(tmp_path / "traces")
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", shell_example("tables-sh")],
        cwd=tmp_path,
        env=bash_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "local-echo-1" in result.stdout
    assert "sum(input_tokens)" in result.stdout


async def test_the_langfuse_recipe(tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.proto", reason="needs the otel extra")
    from tests.otel.test_env import http_receiver

    bundle = await asyncio.to_thread(demo_bundle, tmp_path / "traces")
    public, secret = "pk-lf-readme", "sk-lf-readme-SECRET"
    async with http_receiver() as (url, received):
        script = shell_example("langfuse").replace("https://cloud.langfuse.com", url)
        script = script.replace("<bundle>", str(bundle))
        process = await asyncio.create_subprocess_exec(
            "bash",
            "-euo",
            "pipefail",
            "-c",
            script,
            env=bash_env(LANGFUSE_PUBLIC_KEY=public, LANGFUSE_SECRET_KEY=secret),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    assert stdout.decode().startswith("exported 12 spans of ")
    assert received.paths == ["/api/public/otel/v1/traces"]
    token = base64.b64encode(f"{public}:{secret}".encode()).decode()
    assert received.headers[0]["authorization"] == f"Basic {token}"
    assert len(received.spans) == 12


def test_the_client_api_example(tmp_path: Path) -> None:
    from tests.live_server import live_server, server_env
    from tests.test_readme import example

    code = example("client-api")
    assert "127.0.0.1:50051" in code
    with live_server("--trace-root", str(tmp_path), "--local-word-delay", "0") as served:
        result = subprocess.run(
            [sys.executable, "-c", code.replace("127.0.0.1:50051", served.address)],
            env=server_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ['COMPLETED The tool lookup returned: "42".', "3"]
    bundles = sorted(tmp_path.iterdir())
    assert len(bundles) == 3
    assert any((bundle / "rewards.binpb").is_file() for bundle in bundles)
