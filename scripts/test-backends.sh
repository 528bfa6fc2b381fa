#!/usr/bin/env bash
# Installs what the tests drive beyond Python packages, only where it is missing, from the
# Debian packages: Chromium (and its driver) for the viewer's browser tests; protoc, Go with the
# Go protobuf and gRPC plugins and libraries, and Java's protobuf runtime, for the test that
# builds Go and Java stubs from the protos. Idempotent.
set -euo pipefail

install() {
    if [ "$(id -u)" -ne 0 ]; then
        echo "test-backends: missing $*; install them as root: apt-get install -y $*" >&2
        exit 1
    fi
    echo "test-backends: installing $* from the Debian packages" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# The packages each command or file comes from.
stubs=()
command -v protoc >/dev/null || stubs+=(protobuf-compiler)
command -v go >/dev/null || stubs+=(golang-go)
command -v protoc-gen-go >/dev/null || stubs+=(protoc-gen-go)
command -v protoc-gen-go-grpc >/dev/null || stubs+=(protoc-gen-go-grpc)
command -v javac >/dev/null || stubs+=(default-jdk-headless)
[ -f /usr/share/java/protobuf.jar ] || stubs+=(libprotobuf-java)
[ -d /usr/share/gocode/src/google.golang.org/protobuf ] || stubs+=(golang-google-protobuf-dev)
[ -d /usr/share/gocode/src/google.golang.org/grpc ] || stubs+=(golang-google-grpc-dev)
[ -d /usr/share/gocode/src/google.golang.org/genproto ] || stubs+=(golang-google-genproto-dev)
# The gRPC library needs the APIv2-backed github.com/golang/protobuf (1.5), not 1.3.
dpkg -s golang-github-golang-protobuf-1-5-dev >/dev/null 2>&1 ||
    stubs+=(golang-github-golang-protobuf-1-5-dev)
if [ ${#stubs[@]} -gt 0 ]; then
    install "${stubs[@]}"
fi

if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "test-backends: /usr/bin/chromium is missing; install it as root:" \
            "apt-get install -y chromium chromium-driver" >&2
        exit 1
    fi
    echo "test-backends: installing chromium from the Debian packages" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi
