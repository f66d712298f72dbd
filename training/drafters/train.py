"""The drafter stage: a small LLaMA on the target's tokenizer, trained to draft what the target will accept.

    recsvc train teacher --bundle B --k 20                          # once per target (training/drafters/teacher.py)
    recsvc train drafter --bundle B --method atspeed-s --alpha 0.5 [--out-name atspeed-s]
    torchrun --nproc_per_node 2 -m recsvc.cli.main train drafter ...         # CPU processes (gloo) / GPUs

Methods (docs/DRAFTER_ALIGNMENT.md; losses in ``training/drafters/losses.py``), all ``alpha * L_align +
(1 - alpha) * L_rec``:
- ``sft``: L_rec only, on the same whole-sequence windows as the target (no teacher data needed);
- ``seqkd`` / ``atspeed-s`` / ``atspeed-r``: one forward per training prefix over [prompt + the tree of the
  target's top-K beams + the ground truth] (``teacher.collate_tree``); L_rec comes from the ground-truth
  branch of the same forward, L_align from the teacher data (BUNDLE/teacher, which must come from the bundle's
  current target: rebuild it whenever the target changes);
- ``wordkd`` / ``tvdkd``: the same per-prefix forward with the ground-truth branch only (their alignment is on
  ground-truth prefixes; the teacher data supplies the target's distributions there).

Validation: the next-item loss on validation users, and (``select_by="as"``, the CLI default) AS@K: the mean
number of accepted draft depths per request under strict verification (``recsvc.engine.entry.dispatch``, strict,
with this drafter, N = K, gamma 3; key ``as@K``) and under relaxed sampling verification
(``relaxed_speculative_search``, temperature 1, one seeded generator per user so epochs see the same draws; key
``as_relaxed@K``) on a fixed sample of validation users. The best epoch by the AS of ``verify`` is kept: "auto" =
relaxed for atspeed-r (the method aligns the drafter for relaxed verification), strict for every other method. Output:
BUNDLE/drafter (the served drafter, stage "drafter") or BUNDLE/drafters/<out_name> (what ``recsvc bench drafters``
compares).
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from recsvc.errors import UserError
from training.choices import METHODS, SUPPORTS, VERIFY
from training.target_lm.train import TrainConfig, _best_entry, fit_causal_lm

GT_ONLY = ("wordkd", "tvdkd")  # alignment on ground-truth prefixes: no beams in their batches


def drafter_output_dir(bundle, out_name: str | None) -> Path:
    """BUNDLE/drafter (served) or BUNDLE/drafters/<out_name>."""
    if out_name is None:
        return bundle.drafter_dir
    if not out_name or "/" in out_name or out_name.startswith("."):
        raise UserError(f"--out-name must be a plain directory name, got {out_name!r}")
    return Path(bundle.root) / "drafters" / out_name


def validation_metric(method: str, verify: str, k: int) -> str:
    """The evaluator key an epoch is selected by: ``as@K`` (strict) or ``as_relaxed@K``."""
    if verify not in VERIFY:
        raise UserError(f"--verify must be one of {', '.join(VERIFY)}, got {verify!r}")
    relaxed = verify == "relaxed" or (verify == "auto" and method == "atspeed-r")
    return f"as_relaxed@{k}" if relaxed else f"as@{k}"


def acceptance_evaluator(bundle, builder, trie, data, k: int = 10, max_users: int = 200, gamma: int = 3,
                         draft_beams: int | None = None, dtype: str = "auto", seed: int = 0,
                         batch_size: int = 16, attention: str = "fp32"):
    """model -> {"as@K": accepted draft depths per request and "calls@K": target calls per request under strict
    verification, and "as_relaxed@K" / "calls_relaxed@K" under relaxed sampling verification
    (temperature 1, user i's generator seeded with ``seed + i``)} on a fixed sample of validation users. The
    target is loaded on first use; the drafter is evaluated as served (a ``dtype`` copy; the target in the
    engine's ``attention`` mode)."""
    from recsvc.bundle.loading import torch_dtype
    from recsvc.data.sampling import sample_users
    from recsvc.drafters.llama import LlamaDrafter
    from recsvc.engine.caches.prompts import PromptBatch
    from recsvc.engine.entry.dispatch import decode
    from recsvc.engine.kernels.engine_model import EngineModel
    from recsvc.engine.search.beam_search import BeamSearch
    from recsvc.engine.search.sampling import make_generators

    users = sample_users(data.eval_users("valid"), max_users, seed)
    users.sort(key=lambda u: min(len(u.history), builder.max_history))  # similar prompt lengths per batch
    state: dict[str, Any] = {}

    @torch.inference_mode()
    def evaluate(model) -> dict[str, float]:
        device = next(model.parameters()).device  # the target sits on the drafter's device (searches move the trie)
        if "engine" not in state:
            state["engine"] = BeamSearch(EngineModel.build(bundle.load_target(dtype=dtype, device=str(device)),
                                                           attention), trie, builder.code_offset)
        engine = state["engine"]
        draft = copy.deepcopy(model).to(torch_dtype(dtype, str(device))).eval()
        drafter = LlamaDrafter(EngineModel.build(draft, attention), trie, builder.code_offset)  # as served
        n_draft = draft_beams or k
        accepted, calls, acc_r, calls_r = [], [], [], []
        for i in range(0, len(users), batch_size):
            chunk = users[i : i + batch_size]
            hist = [u.history for u in chunk]
            pb = PromptBatch.from_lists([builder.prompt_ids(h) for h in hist])
            out = decode(engine, drafter, pb, hist, "strict", k, (n_draft, gamma))
            accepted += out.accepted
            calls += out.target_calls
            gens = make_generators([seed + i + j for j in range(len(chunk))])
            rel = decode(engine, drafter, pb, hist, "relaxed", k, (n_draft, gamma), generators=gens)
            acc_r += rel.accepted
            calls_r += rel.target_calls
        n = max(len(accepted), 1)
        return {f"as@{k}": sum(accepted) / n, f"calls@{k}": sum(calls) / n,
                f"as_relaxed@{k}": sum(acc_r) / n, f"calls_relaxed@{k}": sum(calls_r) / n}

    return evaluate


def teacher_source(bundle, builder, data, method: str, alpha: float, k: int | None, support: str = "topk"):
    """The BatchSource of an alignment method over BUNDLE/teacher, and the K it trains with."""
    from tokenizer_rqvae.trie import CatalogTrie
    from training.drafters.losses import code_logprobs_tree, method_loss
    from training.drafters.teacher import TeacherStore, collate_tree, teacher_dir
    from training.target_lm.train import BatchSource

    store = TeacherStore(teacher_dir(bundle))
    store.check_target(bundle)
    k = k or store.k
    if not 1 <= k <= store.k:
        raise UserError(f"--k {k}: the teacher data holds {store.k} beams per prefix")
    beams = 0 if method in GT_ONLY else k  # word-level KD looks at the ground-truth branch only
    users, positions, items = store.user.tolist(), store.position.tolist(), store.item.tolist()
    for u, t, item in zip(users, positions, items, strict=True):
        seq = data.train.get(u, [])
        if t >= len(seq) or seq[t] != item:
            raise UserError("the teacher data was built from another data split: rebuild it with --force")
    trie = CatalogTrie(builder.ids)
    off, pad = builder.code_offset, builder.tokenizer.pad_token_id
    head = len(builder.header_ids)
    lengths = [head + builder.item_len * min(t, builder.max_history) + 3 * (beams + 1) for t in positions]

    def make_batch(idx: list[int]) -> dict[str, torch.Tensor]:
        prompts = [builder.prompt_ids(data.train[users[i]][: positions[i]]) for i in idx]
        return collate_tree(store.rows(idx), prompts, trie, off, pad, beams)

    def loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        lq, lq_gt = code_logprobs_tree(model, batch, off, trie.codebook_size)
        value, _ = method_loss(method, alpha, lq, lq_gt, batch, k, support)
        return value, int(batch["gt"].shape[0])

    return BatchSource(lengths, make_batch, loss), (None if method in GT_ONLY else k)


def train_drafter(
    bundle_dir: str | Path, data_dir: str | Path | None = None, preset: str = "drafter-small", method: str = "sft",
    cfg: TrainConfig | None = None, eval_max_users: int | None = 2000, window_stride: int = 1,
    force: bool = False, *, alpha: float = 0.5, k: int | None = None, select_by: str = "loss",
    as_users: int = 200, as_k: int = 10, gamma: int = 3, draft_beams: int | None = None,
    out_name: str | None = None, init_from: str | Path | None = None, eval_dtype: str = "auto",
    verify: str = "auto", support: str = "topk",
) -> dict[str, Any]:
    """Train a drafter with ``method`` and save it (BUNDLE/drafter, or BUNDLE/drafters/<out_name>).

    ``select_by``: "as" keeps the epoch with the best validation AS@``as_k`` (N = ``draft_beams`` or K,
    ``gamma``, ``as_users`` users; strict and relaxed are both reported, ``verify`` picks the one that selects:
    "auto" = relaxed for atspeed-r, else strict); "loss" the lowest validation loss. ``k``: teacher
    beams per prefix used by the alignment losses (default: all stored). ``init_from``: start from a saved
    drafter (e.g. the SFT one) instead of random weights. ``support``: atspeed-r's TVD support, "topk" (V_c, the
    spec) or "trie" (every trie-allowed code: the paper's "w/o CA" ablation)."""
    from accelerate import PartialState

    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.loading import load_causal_lm, save_causal_lm
    from recsvc.bundle.presets import get_preset, new_model
    from recsvc.data.split import load_split_dir
    from training.target_lm.sequences import count_tokens, eval_examples, train_examples

    if method not in METHODS:
        raise UserError(f"unknown drafter method {method!r}: expected one of {', '.join(METHODS)}")
    if not 0.0 <= alpha <= 1.0:
        raise UserError(f"--alpha must lie in [0, 1], got {alpha}")
    if support not in SUPPORTS:
        raise UserError(f"--support must be one of {', '.join(SUPPORTS)}, got {support!r}")
    if support != "topk" and method != "atspeed-r":
        raise UserError(f"--support {support} applies to atspeed-r only (method {method!r})")
    if select_by not in ("as", "loss"):
        raise UserError(f"select_by must be 'as' or 'loss', got {select_by!r}")
    metric = validation_metric(method, verify, as_k)
    cfg = cfg or TrainConfig()
    p = get_preset(preset)
    if p.role != "drafter":
        raise UserError(f"{preset!r} is a target preset; drafter presets: drafter-tiny, drafter-small, llama-68m")
    dist = PartialState(cpu=not torch.cuda.is_available())
    bundle = Bundle.open(bundle_dir)
    data_path = bundle.resolve_data_dir(data_dir)
    data = load_split_dir(data_path)
    out_dir = drafter_output_dir(bundle, out_name)
    stage = "drafter" if out_name is None else f"drafter:{out_name}"
    ckpt = bundle.checkpoint_dir("drafter" if out_name is None else f"drafter-{out_name}")
    if force and dist.is_main_process:
        shutil.rmtree(ckpt, ignore_errors=True)
        bundle.clear_stage(stage)
    elif not force and (ckpt / "last").is_dir() and not cfg.resume:
        raise UserError(f"{ckpt} holds a checkpoint: pass --resume to continue or --force to start over")
    dist.wait_for_everyone()
    builder = bundle.prompt_builder()
    valid = eval_examples(builder, data.eval_users("valid"), max_users=eval_max_users, seed=cfg.seed)
    if method == "sft":
        train = train_examples(builder, data.train, stride=window_stride)
        tokens, _ = count_tokens(train)
        k_used = None
    else:
        train, k_used = teacher_source(bundle, builder, data, method, alpha, k, support)
        tokens = sum(train.lengths)
    evaluator = None
    if select_by == "as":
        from tokenizer_rqvae.trie import CatalogTrie

        evaluator = acceptance_evaluator(bundle, builder, CatalogTrie(builder.ids), data, as_k, as_users, gamma,
                                         draft_beams, eval_dtype, cfg.seed)
        cfg = replace(cfg, metric=metric)
    if init_from is not None:  # a drafter's --out-name (BUNDLE/drafters/NAME), "drafter", or a model directory
        model = load_causal_lm(bundle.drafter_path(init_from), dtype="fp32").train()
        if model.config.vocab_size != len(builder.tokenizer):
            raise UserError(f"{init_from} has another vocabulary than the bundle's tokenizer")
    else:
        model = new_model(p, builder.tokenizer, seed=cfg.seed)
    n_params = sum(x.numel() for x in model.parameters())
    if dist.is_main_process:
        extra = [] if method == "sft" else [f"alpha {alpha}"]
        extra += [f"K {k_used}"] if k_used else []
        extra += [f"support {support}"] if method == "atspeed-r" else []
        print(f"drafter: {p.name} ({n_params / 1e6:.2f}M parameters), method {method}"
              + (f" ({', '.join(extra)})" if extra else "") + f", ~{tokens} tokens/epoch")
    best, result = fit_causal_lm(model, train, valid, cfg, ckpt, builder.tokenizer.pad_token_id, evaluator,
                                 desc=f"drafter[{method}]")
    info = {"seconds": round(result.seconds, 1), "preset": p.name, "method": method, "params": n_params,
            "epochs": result.epochs, "steps": result.steps, "best_epoch": result.best_epoch,
            "best": _best_entry(result),
            "stopped": result.stopped, "train_tokens_per_s": round(result.train_tokens_per_s, 1),
            "config": asdict(cfg)}
    if method != "sft":
        info.update(alpha=alpha, k=k_used)
    if method == "atspeed-r":
        info["support"] = support
    if out_name is not None:
        info["out"] = str(out_dir)
    if dist.is_main_process:
        save_causal_lm(best, out_dir)
        (out_dir / "training.json").write_text(json.dumps({**info, "history": result.history}, indent=1,
                                                          default=str))
        if out_name is None:
            bundle.update(drafter={"preset": p.name, "method": method})
        bundle.mark_done(stage, **{key: v for key, v in info.items() if key != "config"})
    info["main_process"] = dist.is_main_process
    return info
