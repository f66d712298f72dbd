"""Generated gRPC code for ``protos/recsvc/v1/recommender.proto`` (``python -m recsvc.service.proto_gen``).

Do not edit the ``recommender_pb2*`` files by hand; a test fails when they drift from the proto.
"""

from . import recommender_pb2, recommender_pb2_grpc

__all__ = ["recommender_pb2", "recommender_pb2_grpc"]
