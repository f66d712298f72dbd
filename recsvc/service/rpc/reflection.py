"""Server reflection under both ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

grpcio-reflection (1.85) ships only v1alpha; current tools (grpcurl, Postman, grpcui) ask for v1 first. The v1
protocol is the v1alpha one renamed (same messages, same field numbers, so the same bytes on the wire), so v1
is served by the v1alpha servicer under the v1 service name, and the v1 file descriptor (the v1alpha one with
its package renamed) is added to the descriptor pool so that reflection can describe itself under both names.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME = v1alpha.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"


def _register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Adds grpc/reflection/v1/reflection.proto to ``pool`` (once; a no-op when something provides it)."""
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old = proto.package
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.options.Clear()
    for message in proto.message_type:
        for fld in message.field:
            if fld.type_name.startswith(f".{old}."):
                fld.type_name = f".{V1_PACKAGE}." + fld.type_name[len(old) + 2 :]
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old}.", f".{V1_PACKAGE}.")
            method.output_type = method.output_type.replace(f".{old}.", f".{V1_PACKAGE}.")
    pool.AddSerializedFile(proto.SerializeToString())


def enable_server_reflection(service_names: Iterable[str], server: grpc.Server) -> tuple[str, ...]:
    """Serves reflection for ``service_names`` (plus both reflection services) under v1 and v1alpha; returns
    the full list of names it advertises."""
    pool = descriptor_pool.Default()
    _register_v1_descriptor(pool)
    names = tuple(dict.fromkeys([*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME]))
    servicer = v1alpha.ReflectionServicer(names, pool=pool)
    v1alpha.enable_server_reflection(names, server, pool=pool)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": handler})]
    )
    return names
