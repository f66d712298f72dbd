"""What a search costs, measured beside it without changing what it returns: phase timers (``ledger``), the
device-to-host reads (``host_reads``) and the eager device operations, i.e. kernel launches on a GPU
(``launches``)."""
