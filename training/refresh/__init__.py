"""The daily refresh: yesterday's bundle + the interactions appended since -> today's bundle, gated before it is
published (``recsvc refresh run``), and a split replayed as days to measure it (``recsvc refresh replay``)."""
