"""The generated gRPC code of ``recsvc.v1`` as it was before the wire carried item keys (a verbatim copy of
``recsvc/service/gen/recommender_pb2.py`` and ``recommender_pb2_grpc.py`` at commit 122c7ff, a ``# ruff: noqa``
line prepended): what an old client was built with. ``tests/test_item_keys.py`` calls a new server through
it, in a process of its own (both register the same proto file name in protobuf's default pool)."""
