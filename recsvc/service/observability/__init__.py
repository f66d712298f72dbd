"""What the server says about itself: one JSON object per log line (``logs``) and the Prometheus metrics of one
server instance (``metrics``)."""
