"""The compiled parts: the bundle reader's frame scanner and the writer's text-delta frame, and
the reducer's item description (everything else is in pyproject.toml).

Both are optional: where they cannot be built (no C compiler), the package installs anyway and
reads, writes and reduces bundles in pure Python, only slower.
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
            "trace_reducer.reduce._describe",
            sources=["trace_reducer/reduce/_describe.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
