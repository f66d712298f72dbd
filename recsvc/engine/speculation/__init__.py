"""Speculative decoding: a drafter proposes, the target verifies a whole draft tree in one forward. Here the pieces
both verifications share (``ports``: what a drafter implements and receives; ``rounds``: the requests still
running and their beams; ``autotune``: the draft width and depth per beam width); ``strict/`` and ``relaxed/``
each hold one verification with its sync-free unrolled form."""
