"""The one compiled part: the bundle reader's frame scanner and the writer's text-delta frame
(everything else is in pyproject.toml).

It is optional: where it cannot be built (no C compiler), the package installs anyway and reads
and writes bundles in pure Python, only slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "trace_reducer.bundle._scan",
            sources=["trace_reducer/bundle/_scan.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
