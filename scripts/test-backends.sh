#!/usr/bin/env bash
# Installs what the tests drive beyond Python packages, only where it is missing, from the
# Debian packages: Chromium (and its driver) for the viewer's browser tests; protoc, Go with the
# Go protobuf and gRPC plugins and libraries, and Java's protobuf runtime, for the test that
# builds Go and Java stubs from the protos; valgrind for the benchmark's instruction counts.
# Idempotent.
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
missing=()
command -v protoc >/dev/null || missing+=(protobuf-compiler)
command -v go >/dev/null || missing+=(golang-go)
command -v protoc-gen-go >/dev/null || missing+=(protoc-gen-go)
command -v protoc-gen-go-grpc >/dev/null || missing+=(protoc-gen-go-grpc)
command -v javac >/dev/null || missing+=(default-jdk-headless)
[ -f /usr/share/java/protobuf.jar ] || missing+=(libprotobuf-java)
[ -d /usr/share/gocode/src/google.golang.org/protobuf ] || missing+=(golang-google-protobuf-dev)
[ -d /usr/share/gocode/src/google.golang.org/grpc ] || missing+=(golang-google-grpc-dev)
[ -d /usr/share/gocode/src/google.golang.org/genproto ] || missing+=(golang-google-genproto-dev)
# The gRPC library needs the APIv2-backed github.com/golang/protobuf (1.5), not 1.3.
dpkg -s golang-github-golang-protobuf-1-5-dev >/dev/null 2>&1 ||
    missing+=(golang-github-golang-protobuf-1-5-dev)
[ -x /usr/bin/chromium ] || missing+=(chromium chromium-driver)
# bench.tree_ab --instructions counts under callgrind (tests/test_bench_tree_ab.py).
command -v valgrind >/dev/null || missing+=(valgrind)
if [ ${#missing[@]} -gt 0 ]; then
    install "${missing[@]}"
fi
