"""Train the recurrent draft head (``recsvc/drafters/head_model.py``) by distillation from the served target.

    recsvc train head --bundle B [--method atspeed-s --alpha 0.5] [--k 10] [--prefixes 20000] [--epochs 6]

Data: ``training/drafters/head_traces.py`` (the target's K beams + the truth per training prefix, with the target's
hidden states and next-code distributions along them). For a root at depth j (its hidden state h_j), the head
consumes the codes of depths j+1, j+2, ... and predicts positions j+1 .. L-1; position j itself needs no
head (the target's LM head on h_j gives it exactly, and the engine uses that). Every root j = 0 .. L-2 of every
sequence is trained. The losses are the drafter's (``training/drafters/losses.py``: sft, wordkd, tvdkd, seqkd,
atspeed-s, atspeed-r: ``alpha * L_align + (1 - alpha) * L_rec``), applied per root on the positions it drafts
and averaged over roots.

Validation: the same loss on a held-out 5% of prefixes, and the head's top-K containment on them: the share
of (root, position) pairs of the K beams where the target's beam code is among the head's top-K codes (the
per-depth event that strict verification needs). The best epoch by held-out alignment loss is kept.
Checkpoints per epoch (BUNDLE/checkpoints/head/last) make a run resumable.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from recsvc.errors import UserError
from training.drafters.losses import METHODS, method_loss
from training.target_lm.train import load_checkpoint, save_checkpoint


def head_logprobs(head, hidden: torch.Tensor, ctx: torch.Tensor, codes: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per root depth j: the head's log q at positions j+1 .. L-1 -> {j: [P, S, L - 1 - j, C]}.

    hidden [P, S, L - 1, H] (h_0..h_{L-2}); ctx / codes [P, S, L] (``head_traces.paths``; -1: none)."""
    p, s, levels = ctx.shape
    out: dict[int, torch.Tensor] = {}
    for j in range(levels - 1):
        h = hidden[:, :, j].reshape(p * s, -1)  # [M, H]
        state = head.start(h)
        lq = []
        for t in range(j + 1, levels):  # consume the code chosen at position t - 1 (level t - 1), predict t
            level = torch.full((p * s,), t - 1, dtype=torch.long)
            state, q = head.step(state, h, level, codes[:, :, t - 1].reshape(-1).clamp(min=0))
            lq.append(q.view(p, s, -1))
        out[j] = torch.stack(lq, 2)
    return out


def _targets(batch: dict[str, torch.Tensor], trie) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ctx [P, S, L], codes [P, S, L], allowed [P, S, L, C]) of a batch's sequences."""
    from training.drafters.head_traces import paths

    ctx, codes = paths(trie, batch["leaf"])
    allowed = (trie.children[ctx.clamp(min=0)] >= 0) & (ctx >= 0)[..., None]
    return ctx, codes, allowed


def head_loss(head, batch: dict[str, torch.Tensor], trie, method: str, alpha: float, k: int
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """alpha * L_align + (1 - alpha) * L_rec averaged over root depths (see the module doc). The truth is the
    last sequence of each prefix (its L_rec); the first S - 1 are the target's beams (its L_align)."""
    ctx, codes, allowed = _targets(batch, trie)
    lp = batch["lp"].float()
    levels = ctx.shape[2]
    kk = ctx.shape[1] - 1
    valid = batch["leaf"][:, :kk] >= 0  # [P, K]
    lq = head_logprobs(head, batch["hidden"], ctx, codes)
    total: torch.Tensor | float = 0.0
    logs = {"rec": 0.0, "align": 0.0}
    for j, q in lq.items():
        sl = slice(j + 1, levels)
        tb = {"lp": lp[:, :kk, sl], "lp_gt": lp[:, kk, sl], "codes": codes[:, :kk, sl], "gt": codes[:, kk, sl],
              "allowed": allowed[:, :kk, sl], "valid": valid}
        loss, parts = method_loss(method, alpha, q[:, :kk], q[:, kk], tb, k)
        total = total + loss / len(lq)
        logs = {n: logs[n] + parts[n] / len(lq) for n in logs}
    assert isinstance(total, torch.Tensor)
    return total, logs


@torch.no_grad()
def containment(head, batch: dict[str, torch.Tensor], trie, k: int) -> tuple[int, int]:
    """(hits, pairs): (root, position) pairs of the K beams whose target code is in the head's top-K codes."""
    ctx, codes, allowed = _targets(batch, trie)
    kk = ctx.shape[1] - 1
    lq = head_logprobs(head, batch["hidden"], ctx, codes)
    hits = pairs = 0
    for j, q in lq.items():
        scores = torch.where(allowed[:, :kk, j + 1:], q[:, :kk], float("-inf"))
        top = torch.topk(scores, min(k, scores.shape[-1]), -1).indices  # [P, K, n, k]
        hit = (top == codes[:, :kk, j + 1:, None]).any(-1)  # [P, K, n]
        ok = (batch["leaf"][:, :kk] >= 0)[..., None].expand_as(hit)
        hits += int(hit[ok].sum())
        pairs += int(ok.sum())
    return hits, pairs


def train_head(bundle_dir: str | Path, method: str = "atspeed-s", alpha: float = 0.5, k: int = 10,
               max_prefixes: int | None = 20000, epochs: int = 6, lr: float = 1e-3, batch_size: int = 64,
               seed: int = 0, dtype: str = "auto", out_name: str | None = None, force: bool = False,
               resume: bool = False, progress: bool = True, trace_batch_size: int = 32) -> dict[str, Any]:
    from transformers import get_cosine_schedule_with_warmup

    from recsvc.bundle.directory import Bundle
    from recsvc.data.split import load_split_dir
    from recsvc.drafters.head_model import DraftHead, HeadConfig, load_head, save_head
    from recsvc_base.progress import progress_bar
    from tokenizer_rqvae.trie import CatalogTrie
    from training.drafters.head_traces import build_traces

    if method not in METHODS:
        raise UserError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if not 0.0 <= alpha <= 1.0:
        raise UserError(f"--alpha must lie in [0, 1], got {alpha}")
    if k < 1 or epochs < 1 or batch_size < 1:
        raise UserError("--k, --epochs and --batch-size must be >= 1")
    torch.manual_seed(seed)
    bundle = Bundle.open(bundle_dir)
    data = load_split_dir(bundle.resolve_data_dir())
    ids = bundle.load_ids()
    trie = CatalogTrie(ids)
    out_dir = bundle.head_path(out_name)
    ckpt = bundle.checkpoint_dir("head") / (out_name or "head")
    if force:
        import shutil

        shutil.rmtree(ckpt, ignore_errors=True)
    elif (ckpt / "last").is_dir() and not resume:
        raise UserError(f"{ckpt} holds a checkpoint: pass --resume to continue or --force to start over")
    start = time.monotonic()
    tensors = build_traces(bundle, data, k=k, max_prefixes=max_prefixes, batch_size=trace_batch_size,
                           seed=seed, dtype=dtype, progress=progress)
    trace_seconds = time.monotonic() - start
    n = len(tensors["leaf"])
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = max(1, n // 20)
    val_idx, train_idx = torch.tensor(order[:n_val]), torch.tensor(order[n_val:])

    target = bundle.load_target(dtype="fp32")
    code_offset = bundle.prompt_builder(ids=ids).code_offset
    cfg = HeadConfig(hidden=int(tensors["hidden"].shape[-1]), levels=trie.levels, codebook=trie.codebook_size)
    head = DraftHead(cfg)
    head.init_from_lm_head(target.get_output_embeddings().weight, code_offset)
    del target
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(train_idx) / batch_size)
    total = steps_per_epoch * epochs
    sched = get_cosine_schedule_with_warmup(opt, max(1, total // 20), total)
    history: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    first_epoch = 0
    if resume and (ckpt / "last" / "state.json").is_file():
        state = load_checkpoint(ckpt / "last", head, opt, sched)
        history, best, first_epoch = state["history"], state["best"], state["epoch"]

    def batch_of(idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: t[idx] for name, t in tensors.items()}

    for epoch in range(first_epoch, epochs):
        head.train()
        perm = train_idx[torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(seed + epoch))]
        bar = progress_bar(range(steps_per_epoch), desc=f"head epoch {epoch + 1}/{epochs}", enabled=progress,
                   dynamic_ncols=True, mininterval=2.0)
        run = 0.0
        for i in bar:
            loss, parts = head_loss(head, batch_of(perm[i * batch_size:(i + 1) * batch_size]), trie, method, alpha, k)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            run = 0.98 * run + 0.02 * loss.item() if i else loss.item()
            bar.set_postfix(loss=f"{run:.4f}", align=f"{parts['align']:.4f}")
        head.eval()
        with torch.no_grad():
            vl, va, hits, pairs = 0.0, 0.0, 0, 0
            chunks = val_idx.split(512)
            for c in chunks:
                b = batch_of(c)
                loss, parts = head_loss(head, b, trie, method, alpha, k)
                vl += float(loss) / len(chunks)
                va += parts["align"] / len(chunks)
                h, pr = containment(head, b, trie, k)
                hits, pairs = hits + h, pairs + pr
        entry = {"epoch": epoch + 1, "val_loss": round(vl, 5), "val_align": round(va, 5),
                 "val_topk_containment": round(hits / max(pairs, 1), 4)}
        history.append(entry)
        print(f"head epoch {epoch + 1}: {entry}", flush=True)
        key = "val_loss" if method == "sft" else "val_align"  # sft has no alignment term
        if best is None or entry[key] < best[key]:
            best = entry
            save_head(head, ckpt / "best")
        save_checkpoint(ckpt / "last", head, opt, sched, {"epoch": epoch + 1, "history": history, "best": best})
    assert best is not None
    head = load_head(ckpt / "best")
    info = {"method": method, "alpha": alpha, "k": k, "prefixes": n, "epochs": epochs, "lr": lr,
            "best": best, "history": history, "trace_seconds": round(trace_seconds, 1),
            "seconds": round(time.monotonic() - start, 1), "params": sum(p.numel() for p in head.parameters()),
            "target": json.loads((Path(bundle.root) / "head-traces" / "meta.json").read_text())["target"]}
    save_head(head, out_dir, info)
    if out_name is None:
        bundle.mark_done("head", **{key: v for key, v in info.items() if key != "history"})
    return info

