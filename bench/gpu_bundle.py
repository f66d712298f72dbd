"""`make gpu-bundle` (`python -m bench.gpu_bundle --from SERVED --to DIR`): a served bundle slimmed to what
serving reads, small enough to travel to a GPU machine beside the repository (under ~55 MB).

Kept: bundle.json, the tokenizer, the semantic ids, the target (its weights stored in bf16, what a GPU loads with
``--dtype auto``; config and training record), its dense head, the draft head, the fused priors (``prior`` and
``prior-excl``: the transition table, the SASRec mix), the fresh items and the calibration. Left out: checkpoints,
head traces, the train-only target, the RQ-VAE, the SASRec fit used for validation.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from recsvc.errors import UserError

# (path inside the bundle, required): files and folders copied as they are
KEEP = (("bundle.json", True), ("calibration.json", False), ("popularity.json", False),
        ("calibration_histories.json", False), ("tokenizer", True), ("ids/semantic_ids.json", True),
        ("target/config.json", True), ("target/training.json", False), ("target/generation_config.json", False),
        ("target/dense_head.json", False), ("target/dense_head.safetensors", False), ("head", False),
        ("fresh", False), ("prior/prior.json", False), ("prior/transition.safetensors", False),
        ("prior/sequence", False), ("prior-excl/prior.json", False), ("prior-excl/transition.safetensors", False),
        ("prior-excl/sequence", False))
WEIGHTS = "target/model.safetensors"


def slim(src: Path, dst: Path) -> int:
    """Copies ``src``'s serving files into ``dst`` (replaced), the target's weights as bf16; returns the bytes."""
    import torch
    from safetensors.torch import load_file, save_file

    if not (src / "bundle.json").is_file() or not (src / WEIGHTS).is_file():
        raise UserError(f"no served bundle at {src} (bundle.json and {WEIGHTS} expected): make beauty-bundle first")
    if dst.exists():
        shutil.rmtree(dst)
    for rel, required in KEEP:
        path = src / rel
        if not path.exists():
            if required:
                raise UserError(f"{src} lacks {rel}")
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(path, dst / rel)
        else:
            shutil.copy2(path, dst / rel)
    tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(src / WEIGHTS).items()}
    save_file(tensors, str(dst / WEIGHTS), metadata={"format": "pt"})
    return sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_bundle", description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="src", required=True, help="the served bundle")
    p.add_argument("--to", dest="dst", required=True, help="the slim copy (replaced)")
    args = p.parse_args(argv)
    try:
        size = slim(Path(args.src), Path(args.dst))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.dst}: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
