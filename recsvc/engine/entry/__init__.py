"""The engine's one decoding entry: ``dispatch.decode`` runs a batch in one mode (plain, strict, relaxed, or the
target's own sampling as relaxed's fallback) and returns a ``Decoded`` carrying the ``Decoding`` of the path that
ran (``modes``, torch-free: the service reads it without loading the engine); ``final_read`` reads its lists to
the host in one transfer."""
