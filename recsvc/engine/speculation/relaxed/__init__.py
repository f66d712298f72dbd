"""Relaxed speculation (AtSpeed Algorithm 2, sampling verification): the round loop (``relaxed``), which K of the
accepted drafts a depth keeps (``keep``) and its sync-free form, unrolled like strict's (``unrolled``)."""
