"""Server reflection under both of its names: grpc.reflection.v1 and the older v1alpha.

grpcio-reflection serves only v1alpha, while newer clients (grpc-js tools, buf curl, grpcurl
1.9+) ask for v1 first. The two protocols are the same messages with the same field numbers
under another package, so one servicer answers both; the v1 file descriptor is derived from
the v1alpha one, so that reflection can describe itself under either name.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

V1ALPHA_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
_V1ALPHA_PREFIX = ".grpc.reflection.v1alpha."
_V1_PREFIX = ".grpc.reflection.v1."


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Put grpc/reflection/v1/reflection.proto in pool, unless something already did."""
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    file.name = V1_FILE
    file.package = "grpc.reflection.v1"
    file.ClearField("options")
    for message in file.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(_V1ALPHA_PREFIX, _V1_PREFIX)
    for service in file.service:
        for method in service.method:
            method.input_type = method.input_type.replace(_V1ALPHA_PREFIX, _V1_PREFIX)
            method.output_type = method.output_type.replace(_V1ALPHA_PREFIX, _V1_PREFIX)
    pool.AddSerializedFile(file.SerializeToString())


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Serve reflection of service_names (and of reflection itself) under v1 and v1alpha."""
    pool = descriptor_pool.Default()
    _add_v1_descriptor(pool)
    servicer = ReflectionServicer([*service_names, V1_SERVICE, V1ALPHA_SERVICE], pool=pool)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": v1}),)
    )
