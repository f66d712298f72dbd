"""What a request meets: the gRPC server (health, drain, ``server``), the RPC handlers (``servicer``), the wire
checked into values (``validation``, the rules in ``rules_wire``), dynamic batching (``batcher``), TLS and the
API key (``security``) and server reflection (``reflection``)."""
