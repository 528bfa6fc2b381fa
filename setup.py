"""The compiled parts: the bundle reader's frame scanner and the writer's text-delta frame, the
payloads' JSON encoding, the reducer's item description, and the agent's split of a provider
read into events (everything else is in pyproject.toml).

All are optional: where they cannot be built (no C compiler), the package installs anyway and
reads, writes and reduces bundles and streams from providers in pure Python, only slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "trace_reducer.bundle._scan",
            sources=["trace_reducer/bundle/_scan.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "trace_reducer.bundle._canonical",
            sources=["trace_reducer/bundle/_canonical.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "trace_reducer.reduce._describe",
            sources=["trace_reducer/reduce/_describe.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "agent_server._sse_split",
            sources=["agent_server/_sse_split.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
