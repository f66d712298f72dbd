"""Reads and validates a live-catalog file in another process, so that a server never stalls on it.

``json.loads`` of a large file is one C call that holds the GIL from start to end: in a server's background
thread a 200 MB catalog (30,000 added items) stopped every request for seconds. :func:`read_catalog_isolated`
checks the file's size first (``catalog.file.check_size``: a file over the limit is rejected without being
read), then runs ``python -m recsvc.catalog.reader`` at a lower CPU priority: the child reads, parses and
validates the file against the bundle's ids exactly as ``catalog.file.read_catalog`` does, and sends back only
the validated arrays (item ids [m], codes [m, L], vectors [m, d] float32, retired [r], the additions' keys [m]
as unicode, or [0] when none has one) in ``.npz`` form. The parent's share is a stat, a pipe read and an
``np.load``: it holds the GIL for milliseconds.

Wire format. Parent -> child (stdin): a 4-byte big-endian header length, a JSON header (``path``,
``vector_dim``, ``max_bytes``, ``codebook_size``), then an ``.npz`` of the bundle's ``item_ids`` [n] and
``codes`` [n, L]. Child -> parent (stdout): ``b"K"`` + the catalog's ``.npz``, or ``b"E"`` + the UserError's
message (UTF-8). Any other outcome (a crash, a kill, the time limit) is a UserError naming it.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from recsvc.catalog.file import LiveCatalog, check_size, max_catalog_bytes, read_catalog
from recsvc.errors import UserError
from tokenizer_rqvae.ids import SemanticIds

CHILD_NICE = 10  # the reader yields the CPU to the serving process
_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding recsvc/ and tokenizer_rqvae/


def read_catalog_isolated(path: str | Path, base: SemanticIds, vector_dim: int | None = None,
                          max_bytes: int | None = None, timeout_s: float = 600.0) -> LiveCatalog:
    """``catalog.file.read_catalog`` done by a child process (same checks, same messages)."""
    path = Path(path)
    limit = max_catalog_bytes() if max_bytes is None else max_bytes
    check_size(path, limit)  # before any process starts: an oversized file costs a stat
    header = json.dumps({"path": str(path), "vector_dim": vector_dim, "max_bytes": limit,
                         "codebook_size": int(base.codebook_size)}).encode()
    arrays = io.BytesIO()
    np.savez(arrays, item_ids=base.item_ids, codes=base.codes)
    payload = len(header).to_bytes(4, "big") + header + arrays.getvalue()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "recsvc.catalog.reader"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, close_fds=True)
    try:
        out, err = proc.communicate(payload, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise UserError(f"{path}: not read within {timeout_s:g} s (the catalog reader was stopped)") from None
    if proc.returncode == 0 and out[:1] == b"E":
        raise UserError(out[1:].decode("utf-8", "replace"))
    if proc.returncode != 0 or out[:1] != b"K":
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no message"]
        raise UserError(f"{path}: the catalog reader process failed (exit {proc.returncode}: {tail[0][:200]})")
    with np.load(io.BytesIO(out[1:])) as z:
        return LiveCatalog(int(z["version"]), z["item_ids"], z["codes"], z["vectors"], z["retired"],
                           tuple(str(k) for k in z["keys"].tolist()))


def _child() -> int:
    try:
        os.nice(CHILD_NICE)
    except OSError:
        pass
    data = sys.stdin.buffer.read()
    n = int.from_bytes(data[:4], "big")
    header = json.loads(data[4:4 + n])
    with np.load(io.BytesIO(data[4 + n:])) as z:
        base = SemanticIds(z["item_ids"], z["codes"], int(header["codebook_size"]))
    try:
        catalog = read_catalog(header["path"], base, header["vector_dim"], int(header["max_bytes"]))
    except UserError as exc:
        sys.stdout.buffer.write(b"E" + str(exc).encode("utf-8"))
        return 0
    out = io.BytesIO()
    np.savez(out, version=np.int64(catalog.version), item_ids=catalog.item_ids, codes=catalog.codes,
             vectors=catalog.vectors, retired=catalog.retired, keys=np.asarray(catalog.keys, dtype=np.str_))
    sys.stdout.buffer.write(b"K" + out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(_child())
