"""`agent-server health`: ask a server's grpc.health.v1 service whether it serves (for probes)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from rollout_client import ADDRESS_ENV, DEFAULT_ADDRESS, address_from_env, url_address

PROG = "agent-server health"
# CA certificates are a few KiB (a system bundle a few hundred); /dev/zero is none.
_MAX_CA_BYTES = 16 << 20


def unreachable(address: str, detail: str) -> str:
    """What a client command says when no server answers at its address: the cause, and the
    two fixes (start one, or point the command at the one that runs); or, when a server does
    answer but the two disagree on TLS, which flag to change."""
    # A server answered: "start one" would send the user after the wrong fix (was the whole
    # chain, `… Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: …`, then it).
    if "WRONG_VERSION_NUMBER" in detail:
        return (
            f"the server at {address} does not serve TLS (it was started without --tls-cert): "
            "leave out --tls and --tls-ca"
        )
    untrusted = re.search(r"CERTIFICATE_VERIFY_FAILED: ([^:;)]+)", detail)
    if untrusted is not None:
        return (
            f"the server at {address} serves TLS with a certificate this command does not trust "
            f"({untrusted[1].strip()}): give the certificate, or its CA's, with --tls-ca PEM"
        )
    if "Socket closed" in detail:
        detail = (
            "it closed the connection, as a TLS server does to a plaintext client: "
            "--tls or --tls-ca PEM if it serves TLS"
        )
    # gRPC's detail is a chain ("failed to connect to all addresses; last error: ..."): the
    # causes a newcomer meets are said in their words.
    elif "Connection refused" in detail:
        detail = "connection refused"
    elif "resolving" in detail or "lookup" in detail:
        detail = "its host name does not resolve"
    elif "Failed parsing HTTP/2" in detail:
        detail = "something other than gRPC listens there"
    return (
        f"no agent server answers at {address} ({detail}); start one with "
        f"`agent-server serve`, or give its address with --address or ${ADDRESS_ENV}"
    )


# A probe that waits longer than this is waiting for nothing; past it gRPC's deadline overflows.
MAX_TIMEOUT = 3600.0


def address_problem(address: str) -> str | None:
    """Why a client command's --address cannot name a server (for a usage error), or None.
    An empty one (`--address "$ADDR"` with ADDR unset) was tried as it is, and answered with
    a status and no address (`: UNKNOWN`)."""
    if not address.strip():
        return f"--address is empty: give the server's HOST:PORT (default {DEFAULT_ADDRESS})"
    # "its host name does not resolve" sent the user after DNS.
    in_url = url_address(address)
    if in_url is not None:
        host, tls = in_url
        with_tls = " with --tls" if tls else ""
        return f"--address takes the server's HOST:PORT, not a URL: give {host}{with_tls}"
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Print the server's health status. Exit codes: 0 SERVING; 1 not serving, or no server "
        "answers (one line says why); 2 an empty --address or a URL (it takes HOST:PORT), a "
        "--timeout that is not a number of seconds above 0 and at most 3600, or a --tls-ca "
        "file that cannot be read."
    )
    parser.add_argument(
        "--address",
        default=address_from_env(),
        help=f"the server (default ${ADDRESS_ENV}, else {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="seconds to wait for the answer (default 3)",
    )
    parser.add_argument("--tls", action="store_true", help="connect with TLS, system CAs")
    parser.add_argument("--tls-ca", type=Path, metavar="PEM", help="connect with TLS, these CAs")


# grpc.health.v1 on the wire, by hand: importing the generated messages would load protobuf
# (a quarter of the probe's start-up) for an empty request and a one-field answer.
CHECK_METHOD = "/grpc.health.v1.Health/Check"
# HealthCheckResponse.ServingStatus, in the order of its enum.
SERVING_STATUS = ("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")
_SERVING = 1
_STATUS_TAG = 0x08  # field 1, varint


def serving_status(reply: bytes) -> int:
    """The `status` of a serialized HealthCheckResponse (0 when absent; unknown fields are
    skipped, as protobuf's parser would)."""
    status = 0
    position = 0
    while position < len(reply):
        key, position = _varint(reply, position)
        kind = key & 7
        if kind == 0:
            value, position = _varint(reply, position)
            if key == _STATUS_TAG:
                status = value
        elif kind == 2:
            length, position = _varint(reply, position)
            position += length
        elif kind == 1:
            position += 8
        elif kind == 5:
            position += 4
        else:
            raise ValueError(f"a HealthCheckResponse with wire type {kind}")
    if position > len(reply):
        raise ValueError("a truncated HealthCheckResponse")
    return status


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise ValueError("a truncated HealthCheckResponse")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def run(args: argparse.Namespace) -> int:
    """Print the status; exit 0 when SERVING, 1 otherwise (or when the server cannot be asked)."""
    # Imported here, not above: `--help` needs none of gRPC.
    import grpc

    from grpc_common._files import read_given_file

    problem = address_problem(args.address)
    if problem is None and not (0 < args.timeout <= MAX_TIMEOUT):  # NaN fails it too
        problem = f"--timeout must be a number of seconds above 0, at most {MAX_TIMEOUT:g}"
    if problem is not None:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    if args.tls or args.tls_ca is not None:
        try:
            # A FIFO, a directory or a device is said to be one (a FIFO was waited on).
            roots = (
                read_given_file(args.tls_ca, "--tls-ca", limit=_MAX_CA_BYTES)
                if args.tls_ca is not None
                else None
            )
        except ValueError as error:
            print(f"{PROG}: {error}", file=sys.stderr)
            return 2
        channel = grpc.secure_channel(args.address, grpc.ssl_channel_credentials(roots))
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        # An empty HealthCheckRequest (the whole server) is zero bytes.
        check = channel.unary_unary(
            CHECK_METHOD, request_serializer=None, response_deserializer=None
        )
        try:
            reply = check(b"", timeout=args.timeout)
        except grpc.RpcError as error:
            call = error if isinstance(error, grpc.Call) else None
            code = call.code() if call else grpc.StatusCode.UNKNOWN
            if code == grpc.StatusCode.UNAVAILABLE:
                message = unreachable(args.address, (call and call.details()) or code.name)
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                message = f"{args.address} did not answer within {args.timeout:g} s (--timeout)"
            else:
                message = f"{args.address}: {code.name}"
            print(f"{PROG}: {message}", file=sys.stderr)
            return 1
    try:
        status = serving_status(reply)
    except ValueError as error:
        print(f"{PROG}: {args.address}: {error}", file=sys.stderr)
        return 1
    name = SERVING_STATUS[status] if status < len(SERVING_STATUS) else f"status {status}"
    print(name)
    return 0 if status == _SERVING else 1
