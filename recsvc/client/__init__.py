"""The gRPC client of the Recommend service: RecClient (client.py), the sticky client (sticky.py, over
routing.py's hash ring) and the `recsvc client` command (cli.py). The server never imports it."""
