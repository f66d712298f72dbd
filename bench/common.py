"""Shared pieces of the `recsvc bench ...` commands: loading a bundle's parts, users, output."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from recsvc.bundle.loading import PRECISIONS
from recsvc.data.split import EVAL_SPLITS
from recsvc.engine.kernels.plan import ATTENTIONS
from recsvc.errors import UserError
from recsvc.hardware import DEVICES

PRIOR_USES = ("auto", "off")  # --prior: the bundle's prior as served, or none

if TYPE_CHECKING:  # the engine is imported when a bench runs, not when the bench's commands are listed
    from transformers import PreTrainedModel

    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.prompt import PromptBuilder
    from recsvc.data.split import EvalUser, SplitData
    from tokenizer_rqvae.trie import CatalogTrie


@dataclass(frozen=True)
class BenchContext:
    """A bundle's target and catalog (``recsvc.recommender.parts.load_target``), its data and the sampled users."""

    bundle: Bundle
    model: PreTrainedModel  # the target's transformers model: a bench wraps it in the attention and forward it times
    builder: PromptBuilder
    trie: CatalogTrie  # on the target's device
    users: list[EvalUser]
    data: SplitData

    @property
    def bundle_dir(self) -> Path:
        return self.bundle.root


def load_context(bundle_dir: str | Path, users: int, split: str = "test", dtype: str = "auto",
                 data_dir: str | Path | None = None, seed: int = 0, device: str = "cpu") -> BenchContext:
    """``device``: where the target (and the trie) live: "cpu" or "cuda"."""
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir
    from recsvc.recommender.parts import PartsChoice, load_target

    parts = load_target(bundle_dir, PartsChoice.target_only(dtype, device))
    if parts.target is None or parts.prompts is None:
        raise UserError(f"{bundle_dir} holds an item-level target (bundle.json architecture \"items\"): this "
                        "bench measures a token target's decoding (serve it, or bench it with `recsvc bench serve`)")
    data = load_split_dir(parts.bundle.resolve_data_dir(data_dir))
    return BenchContext(parts.bundle, parts.target.model, parts.prompts, parts.trie,
                        sample_users(data.eval_users(split), users, seed), data)


def add_bundle_bench_args(p, ks: str, attention: str) -> None:
    """The flags every bench over a bundle's users shares: the bundle, users, K values, split, dtype, data,
    threads, attention (``attention``: its default), device, JSON output."""
    p.add_argument("--bundle", required=True)
    p.add_argument("--users", type=int, default=200)
    p.add_argument("--k", default=ks)
    p.add_argument("--split", choices=EVAL_SPLITS, default="test")
    p.add_argument("--dtype", choices=PRECISIONS, default="auto")
    p.add_argument("--data", help="data directory (default: the bundle's)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--attention", choices=ATTENTIONS, default=attention,
                   help="engine attention: exact (bit-identical to generate) or fp32 (faster on CPUs)")
    add_device_arg(p)
    p.add_argument("--json", dest="json_path")


def add_device_arg(p) -> None:
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="where the target and drafters run (cuda: bf16 with --dtype auto)")


def synchronize(device: str) -> None:
    """Wait for the device's queued work (CUDA), so a timer read after it measures the work: nothing on CPU."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, *args, device: str = "cpu", **kwargs) -> tuple[Any, float]:
    """(result, milliseconds); on CUDA the device's work is finished before the clock is read."""
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    synchronize(device)
    return out, 1000 * (time.perf_counter() - start)
