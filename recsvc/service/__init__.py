"""The gRPC service (``recsvc serve``). Its rooms, in the order an operator meets them (each room imports only the
rooms listed after it):

- ``startup``: one serving process from its flags to its exit (``process``), ``--processes N`` (``workers``),
  the served engine's settings and its one constructor (``settings``), the ``--spec auto`` calibration and its
  stored choice (``calibration``, ``calibration_cache``), the model-free popularity recommender (``popularity``);
- ``rpc``: what a request meets: the gRPC server, the servicer's handlers, the wire checked into values
  (``validation``, ``rules_wire``), the batcher, TLS and the API key (``security``), reflection;
- ``swap``: what is served, followed while serving: a new bundle version (``bundle_watch``), the live catalog
  (``catalog_watch``), their poll thread, the loader's throttle and the calls it yields to (``call_activity``);
- ``stores``: the users' histories: in process, Redis, Redis Cluster;
- ``observability``: what the server says about itself: JSON log lines (``logs``), Prometheus metrics
  (``metrics``).

Beside them: ``cli`` (the ``recsvc serve`` command, above every room), ``arg_types`` (the flags' value types,
shared with ``recsvc eval`` and the client), ``proto_gen`` (``python -m recsvc.service.proto_gen`` regenerates
``gen/``, the generated gRPC code that the rpc room and the client read).
"""
