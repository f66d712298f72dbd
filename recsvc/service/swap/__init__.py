"""What is served, followed while serving: a new bundle version loaded beside the serving one and swapped in
(``bundle_watch``), the live catalog file (``catalog_watch``), the poll thread both run on (``poll_thread``), the
loader's throttle (``loader_throttle``) and the calls being answered that it yields to (``call_activity``)."""
