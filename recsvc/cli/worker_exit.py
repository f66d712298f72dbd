"""How a ``torchrun`` / ``accelerate launch`` worker of a ``recsvc`` command ends.

With two ranks on two loaded cores, about one run in ten had a rank that had finished its work and destroyed
its process group abort afterwards, in the interpreter's teardown ("terminate called without an active
exception", no Python frame left), and torchrun then failed the whole finished job. A worker therefore ends
with ``os._exit`` once its command has returned: the process group destroyed, stdout / stderr flushed, and
nothing of the command's own left to run (its files are written and closed by then).
"""

from __future__ import annotations

import os
import sys


def is_torchrun_worker() -> bool:
    """One process of several started by torchrun / accelerate launch (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def finish_worker(code: int) -> None:
    """Under torchrun: destroy the process group (if any), flush, and leave with ``code`` without the
    interpreter's teardown. Elsewhere: return (the caller exits normally)."""
    if not is_torchrun_worker():
        return
    if "torch" in sys.modules:  # a command that never imported torch has no process group
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
