"""Strict speculation (AtSpeed Algorithm 1, lossless: the target's own top-K beams): the round loop
(``speculative``) and its sync-free form over a static forward, rounds unrolled on the device (``unrolled``)."""
