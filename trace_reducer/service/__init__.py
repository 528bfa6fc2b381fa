"""`ReducerService`: the reducer over gRPC, reading bundles confined under one root."""

from ._service import SERVICE_NAME, ReducerService, add_to_server

__all__ = ["SERVICE_NAME", "ReducerService", "add_to_server"]
