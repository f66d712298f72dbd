"""`recsvc train drafter` under torchrun: 2 CPU processes (gloo DDP), an alignment method, AS validation."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from test_drafter_fixtures import tiny_bundle

from recsvc.bundle.directory import Bundle
from training.drafters.teacher import build_teacher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_training(tmp_path) -> None:
    root = tiny_bundle(tmp_path)
    build_teacher(root, k=3, max_prefixes=160, batch_size=16, shard_size=64, progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "recsvc.cli.main", "train", "drafter", "--bundle", str(root),
           "--preset", "drafter-tiny", "--method", "atspeed-s", "--epochs", "2", "--batch-size", "8", "--bf16", "off",
           "--as-users", "4", "--as-k", "3", "--eval-users", "10", "--out-name", "ddp", "--threads", "1"]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout[proc.stdout.index("{"):])  # printed once, by the main process
    assert proc.stdout.count('"method"') == 1
    assert info["steps"] == 2 * ((160 // 8) // 2)  # each rank takes half of the 20 batches per epoch
    assert info["best"]["metric"] == "as@3" and info["k"] == 3
    assert (Bundle.open(root).root / "drafters" / "ddp" / "model.safetensors").is_file()
    assert seconds < 60, seconds
