# The agent server as a container. Untested: the machines this project is built and tested on
# run no container engine. Build and run:
#   docker build -t rollout-trace .
#   docker run -p 50051:50051 -p 9464:9464 -v "$PWD/traces:/traces" rollout-trace
# Settings come from the environment (ROLLOUT_*, below) or `serve` flags after the image name.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE constraints.txt ./
COPY rollout ./rollout
COPY grpc_common ./grpc_common
COPY trace_reducer ./trace_reducer
COPY rollout_client ./rollout_client
COPY agent_server ./agent_server
# A C compiler only while installing, for the bundle reader's frame scanner (_scan.c).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install -c constraints.txt . \
    && apt-get purge -y --auto-remove gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin agent \
    && mkdir /traces \
    && chown agent /traces

USER agent
WORKDIR /traces
ENV ROLLOUT_LISTEN=0.0.0.0:50051 \
    ROLLOUT_METRICS_LISTEN=0.0.0.0:9464 \
    ROLLOUT_TRACE_ROOT=/traces \
    ROLLOUT_LOG_FORMAT=json
EXPOSE 50051 9464
VOLUME ["/traces"]

HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["agent-server", "health", "--address", "127.0.0.1:50051"]

ENTRYPOINT ["agent-server"]
CMD ["serve"]
