"""Train the target LM: whole-sequence windows, AdamW + warmup/cosine, checkpoints, resume, early stopping.

    recsvc train target --data data/beauty --bundle artifacts/beauty --preset small
    accelerate launch --multi_gpu --num_processes 4 -m recsvc.cli.main train target ...   # data parallel
    torchrun --nproc_per_node 2 -m recsvc.cli.main train target ...  # CPU processes (gloo), for tests

``fit_causal_lm`` is the generic loop (the drafter reuses it); ``train_target`` is the bundle stage.
The model is trained on TRAIN sequences only; validation asks for the valid items given the train items
(early stopping), and the test evaluation later uses history = train + valid (see training/target_lm/sequences.py).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from recsvc.bundle.prompt import IGNORE_INDEX
from recsvc.errors import UserError
from training.choices import ALIGN_MODES, BF16_MODES, PROTOCOLS, REFIT_MODES
from training.target_lm.budget import contention_warning, plan_schedule
from training.target_lm.loop_state import LoopState
from training.target_lm.selection import PER_USER, SELECT_RULES, selection_table
from training.target_lm.sequences import Example, bucketed_batches, collate

# model -> {"recall@10": ..., ...}; optionally "per_user": {"recall@10": [one value per user]}
# (training.target_lm.selection)
Evaluator = Callable[[Any], dict[str, Any]]


@dataclass
class TrainConfig:
    epochs: int = 8
    batch_size: int = 32  # windows per micro-batch (per process)
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: float = 0.05  # < 1: fraction of all optimizer steps; >= 1: steps
    max_grad_norm: float = 1.0
    seed: int = 0
    max_minutes: float | None = None  # wall-clock budget (training + evaluation); stops cleanly
    fit_budget: bool = False  # size the schedule to the epochs that fit max_minutes (at most `epochs`)
    patience: int = 2  # epochs without improvement before stopping; 0 = never stop early
    bf16: str = "auto"  # auto | on | off: bf16 autocast
    optimizer: str = "fused"  # training.choices.OPTIMIZERS: the AdamW implementation
    resume: bool = False
    metric: str = "recall@10"  # evaluator key to maximise (validation loss when there is no evaluator)
    select: str = "best"  # training.target_lm.selection rule: best | within-se (the CLI's default)
    stop_after: int | None = None  # train only the first N epochs of the schedule (the scratch refit)
    eval_batch_size: int = 64
    dropout: float = 0.0  # training.target_lm.dropout: on the embeddings and each sub-layer's output (0: none)


@dataclass
class FitResult:
    epochs: int  # epochs completed
    steps: int  # optimizer steps
    best_epoch: int
    best_score: float  # the evaluator's metric (higher is better) or -valid_loss
    score_name: str  # "recall@10" or "-valid_loss"
    stopped: str  # "epochs" | "patience" | "max_minutes"
    seconds: float
    train_tokens_per_s: float
    history: list[dict[str, float]] = field(default_factory=list)
    schedule_epochs: int = 0  # epochs the warmup/cosine schedule spans (cfg.epochs, or the budget plan's)
    budget_plan: dict[str, Any] | None = None  # training.target_lm.budget.plan_schedule's record (fit_budget)
    selection: list[dict[str, Any]] = field(default_factory=list)  # training.target_lm.selection.selection_table
    lrs: list[float] = field(default_factory=list)  # the learning rate after each evaluation's step


def resolve_bf16(mode: str, device: torch.device) -> bool:
    """bf16 autocast? "auto": on CUDA with bf16 support, and on CPUs with native bf16 (AVX512-BF16 or AMX).

    Measured on the 2-core dev CPU (AVX512-BF16, no AMX), small preset, 200 steps on Beauty, same seed and
    batches: bf16 3.9k tokens/s vs fp32 2.0k, valid loss 5.559 vs 5.521 after 200 steps (curves identical
    to 3 decimals for the first 150 steps). Per wall-clock minute bf16 is far ahead, so it is the default.
    """
    if mode not in BF16_MODES:
        raise UserError(f"--bf16 must be auto, on or off, not {mode!r}")
    if mode != "auto":
        return mode == "on"
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        try:  # private helpers of torch.cpu; absent -> fp32
            return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        except AttributeError:
            return False
    return False


def labelled_logits(model, batch: dict[str, torch.Tensor], fusion: Callable | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logits [B, P, V], their targets [B, P]) at the positions ``keep`` = {p : labels[:, p+1] labelled in
    some row}: position p predicts token p + 1, and lm_head runs only there. ``fusion(logits, keep, batch)``: the
    prior added to them (``training.target_lm.prior_loss.PriorFusion``)."""
    labels = batch["labels"][:, 1:]  # [B, T-1]
    keep = (labels != IGNORE_INDEX).any(dim=0).nonzero().squeeze(1)  # [P]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=keep)
    logits = out.logits.float()
    return (logits if fusion is None else fusion(logits, keep, batch)), labels[:, keep]


def lm_loss(model, batch: dict[str, torch.Tensor], fusion: Callable | None = None) -> tuple[torch.Tensor, int]:
    """(mean cross-entropy over labelled tokens, label count); lm_head runs only where some row has a label."""
    logits, target = labelled_logits(model, batch, fusion)  # [B, P, V], [B, P]
    n = int((target != IGNORE_INDEX).sum())
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / max(n, 1), n


@torch.no_grad()
def validation_loss(model, examples: Sequence[Example], pad_id: int, batch_size: int, device,
                    bf16: bool) -> float:
    """Mean code-token cross-entropy over ``examples`` (nats per code token)."""
    return validation_losses(model, examples, pad_id, batch_size, device, bf16)[0]


@torch.no_grad()
def validation_losses(model, examples: Sequence[Example], pad_id: int, batch_size: int, device,
                      bf16: bool) -> tuple[float, list[float]]:
    """(mean code-token cross-entropy over ``examples``, each example's own mean in ``examples``' order): the
    per-example values give the loss's standard error (``training.target_lm.selection``)."""
    if not examples:
        return float("nan"), []
    total, count = 0.0, 0
    each = [float("nan")] * len(examples)
    for idx in bucketed_batches([len(e) for e in examples], batch_size, seed=None):
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in idx], pad_id).items()}
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            logits, target = labelled_logits(model, batch)  # [B, P, V], [B, P]
        nll = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE_INDEX, reduction="none")  # [B, P]
        n = (target != IGNORE_INDEX).sum(dim=1)  # [B]
        for row, i in enumerate(idx):
            each[i] = float(nll[row].sum() / n[row].clamp(min=1))
        total += float(nll.sum())
        count += int(n.sum())
    return total / max(count, 1), each


def validation_pass(valid: Sequence[Example], pad_id: int, cfg: TrainConfig, device, bf16: bool,
                    evaluator: Evaluator | None) -> Callable[[Any], None]:
    """model -> None: the work of one validation pass (the loss over ``valid``, then ``evaluator``), for timing."""

    def run(model) -> None:
        validation_loss(model, valid, pad_id, cfg.eval_batch_size, device, bf16)
        if evaluator is not None:
            evaluator(model)

    return run


@dataclass(frozen=True)
class BatchSource:
    """What the loop trains on, when it is not whole-sequence windows (the drafter's alignment methods).

    lengths: one per example (similar lengths are batched together); make_batch(indices) -> tensors (moved to
    the device by the loop; an optional 0-dim "num_tokens" counts tokens for the throughput display, else the
    2-D "attention_mask" is summed); loss(model, batch) -> (mean loss, count)."""

    lengths: Sequence[int]
    make_batch: Callable[[list[int]], dict[str, torch.Tensor]]
    loss: Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, int]]

    @classmethod
    def windows(cls, examples: Sequence[Example], pad_id: int) -> BatchSource:
        """Causal-LM windows (the default): collate + ``lm_loss``."""
        return cls([len(e) for e in examples], lambda idx: collate([examples[i] for i in idx], pad_id), lm_loss)


def _batch_tokens(batch: dict[str, torch.Tensor]) -> int:
    if "num_tokens" in batch:
        return int(batch["num_tokens"])
    return int(batch["attention_mask"].sum())


def fit_causal_lm(
    model,
    train: Sequence[Example] | BatchSource,
    valid: Sequence[Example],
    cfg: TrainConfig,
    ckpt_dir: Path,
    pad_id: int,
    evaluator: Evaluator | None = None,
    desc: str = "train",
) -> tuple[Any, FitResult]:
    """Train ``model`` in place; returns (the best model, unwrapped, best weights loaded; FitResult).

    ``train``: windows (Examples, trained with ``lm_loss``) or any ``BatchSource`` (its own batches and loss).
    ``valid``: Examples for the validation loss (next-item cross-entropy). ``cfg.dropout``: dropout while this
    fit trains (``TrainingDropout``; off again when it returns)."""
    from training.target_lm.dropout import TrainingDropout

    with TrainingDropout.attach(model, cfg.dropout):
        return _fit(model, train, valid, cfg, ckpt_dir, pad_id, evaluator, desc)


def _fit(model, train: Sequence[Example] | BatchSource, valid: Sequence[Example], cfg: TrainConfig, ckpt_dir: Path,
         pad_id: int, evaluator: Evaluator | None, desc: str) -> tuple[Any, FitResult]:
    """``fit_causal_lm``'s loop."""
    from accelerate import Accelerator
    from accelerate.utils import broadcast_object_list, set_seed

    from recsvc_base.progress import progress_bar

    source = train if isinstance(train, BatchSource) else BatchSource.windows(train, pad_id)
    if not source.lengths:
        raise UserError("no training examples (every user has fewer than 2 items?)")
    start = time.monotonic()
    set_seed(cfg.seed)
    acc = Accelerator(cpu=not torch.cuda.is_available())  # cpu=True: torchrun on CPUs -> gloo DDP
    bf16 = resolve_bf16(cfg.bf16, acc.device)
    model.to(acc.device)  # before the --fit-budget probe, whose copy and batches must share the device
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr,
                                  fused=cfg.optimizer == "fused")
    lengths = list(source.lengths)
    world, rank = acc.num_processes, acc.process_index
    n_batches = math.ceil(len(lengths) / cfg.batch_size) // world  # per process, equal on every rank
    if n_batches == 0:
        raise UserError(f"{len(lengths)} examples are too few for batch size {cfg.batch_size} x {world} processes")

    budget_plan = None
    if cfg.fit_budget and cfg.epochs > 0:
        if cfg.max_minutes is None:
            raise UserError("--fit-budget sizes the schedule to --max-minutes: give --max-minutes")
        budget_plan = _saved_budget_plan(ckpt_dir) if cfg.resume else None
        if budget_plan is None:
            plans = [None]
            if acc.is_main_process:
                plans[0] = plan_schedule(
                    model, lambda idx: {k: v.to(acc.device) for k, v in source.make_batch(idx).items()},
                    source.loss, lengths, cfg.batch_size, world, cfg.lr, cfg.weight_decay, bf16,
                    validation_pass(valid, pad_id, cfg, acc.device, bf16, evaluator),
                    cfg.max_minutes, time.monotonic() - start, cfg.epochs, seed=cfg.seed)
            broadcast_object_list(plans)
            budget_plan = plans[0]
        acc.print(f"{desc}: --fit-budget: {budget_plan['epochs']} epoch(s) in {cfg.max_minutes:g} min "
                  f"(epoch {budget_plan['epoch_seconds'] / 60:.2f} min + validation "
                  f"{budget_plan['eval_seconds'] / 60:.2f} min, "
                  f"{budget_plan['train_tokens_per_s']} tokens/s)")
        if (warning := contention_warning(budget_plan)) is not None:
            acc.print(f"{desc}: warning: {warning}")
    schedule_epochs = budget_plan["epochs"] if budget_plan else cfg.epochs
    saved_schedule = _saved_state(ckpt_dir).get("schedule_epochs") if cfg.resume else None
    if saved_schedule is not None and saved_schedule != schedule_epochs:  # a resumed run keeps its schedule
        acc.print(f"{desc}: the checkpoint's schedule spans {saved_schedule} epoch(s): kept (not {schedule_epochs})")
        schedule_epochs = saved_schedule
    if cfg.select not in SELECT_RULES:
        raise UserError(f"--select must be one of {', '.join(SELECT_RULES)}, not {cfg.select!r}")
    last_epoch = min(schedule_epochs, cfg.stop_after) if cfg.stop_after is not None else schedule_epochs
    model, optimizer = acc.prepare(model, optimizer)
    scheduler = cosine_schedule(optimizer, math.ceil(n_batches / cfg.grad_accum), schedule_epochs, cfg.warmup)

    state = LoopState(schedule_epochs=schedule_epochs, budget_plan=budget_plan)
    if cfg.resume and (ckpt_dir / "last" / "state.json").is_file():
        saved = load_checkpoint(ckpt_dir / "last", acc.unwrap_model(model), optimizer, scheduler)
        state = LoopState.resumed(saved, state, ckpt_dir / "last")
        acc.print(f"resumed {desc} from epoch {state.epoch} batch {state.batch} (step {state.step})")
    score_name = cfg.metric if evaluator else "-valid_loss"
    stopped = "epochs"

    def evaluate(epoch_float: float) -> tuple[dict[str, float], list[float] | None]:
        model.eval()
        row: dict[str, float] = {"epoch": epoch_float}
        row["valid_loss"], losses = validation_losses(model, valid, pad_id, cfg.eval_batch_size, acc.device, bf16)
        per_user: list[float] | None = [-x for x in losses] or None  # the score is minus the loss
        if evaluator is not None:
            metrics = [evaluator(acc.unwrap_model(model)) if acc.is_main_process else None]
            broadcast_object_list(metrics)  # one evaluation, every rank gets the numbers
            values = dict(metrics[0])
            per_user = values.pop(PER_USER, {}).get(cfg.metric)
            if cfg.metric not in values:
                raise UserError(f"evaluator returned no {cfg.metric!r} (got {sorted(values)})")
            row.update({k: float(v) for k, v in values.items()})
        model.train()
        return row, per_user

    def over_budget() -> bool:
        return cfg.max_minutes is not None and time.monotonic() - start > cfg.max_minutes * 60

    model.train()
    while state.epoch < last_epoch and stopped == "epochs":
        epoch = state.epoch
        batches = bucketed_batches(lengths, cfg.batch_size, seed=cfg.seed * 1000 + epoch)
        batches = batches[rank::world][:n_batches]
        bar = progress_bar(total=n_batches, initial=state.batch, desc=f"{desc} epoch {epoch + 1}/{last_epoch}",
                           enabled=acc.is_local_main_process, dynamic_ncols=True, mininterval=1.0)
        t0, tokens, loss_ema = time.monotonic(), 0, None
        for b in range(state.batch, n_batches):
            group_end = min((b // cfg.grad_accum + 1) * cfg.grad_accum, n_batches)
            group = group_end - (b // cfg.grad_accum) * cfg.grad_accum  # micro-batches in this step
            sync = b + 1 == group_end
            batch = {k: v.to(acc.device) for k, v in source.make_batch(batches[b]).items()}
            with acc.no_sync(model) if not sync else nullcontext():
                with torch.autocast(device_type=acc.device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss, _ = source.loss(model, batch)
                acc.backward(loss / group)
            if sync:
                if cfg.max_grad_norm:
                    acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.step += 1
            tokens += _batch_tokens(batch) * world
            loss_val = float(loss.detach())
            loss_ema = loss_val if loss_ema is None else 0.98 * loss_ema + 0.02 * loss_val
            state.batch = b + 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{tokens / (time.monotonic() - t0):.0f}",
                            lr=f"{scheduler.get_last_lr()[0]:.2e}")
            if sync and over_budget():
                stopped = "max_minutes"
                break
        bar.close()
        state.train_seconds += time.monotonic() - t0
        state.train_tokens += tokens
        finished_epoch = state.batch >= n_batches
        row, per_user = evaluate(state.elapsed_epochs(n_batches))
        row["train_loss"] = loss_ema if loss_ema is not None else float("nan")
        state.lrs.append(scheduler.get_last_lr()[0])  # after the evaluated step
        score = row[cfg.metric] if evaluator else -row["valid_loss"]
        selecting = not math.isnan(score)
        if not selecting:  # nothing to select on (the deploy refit): the latest epoch is the best
            score, per_user = state.elapsed_epochs(n_batches), None
        state.scores.append({"epoch": row["epoch"], "score": score,
                                "per_user": None if per_user is None else [round(x, 6) for x in per_user]})
        table = _selection(state.scores, cfg.select)
        now = table[-1]
        note = ""
        if selecting:  # nested, so that the record's curves (recsvc/report/curves.py) plot only the metrics
            row["selection"] = {k: now[k] for k in ("se", "vs_best", "vs_best_se", "chosen")}
            top = next(r for r in table if r["best"])
            sign = -1 if score_name.startswith("-") else 1  # printed in the metric's own direction
            note = (f" | {score_name.lstrip('-')} {sign * now['mean']:.4f}"
                    + (f" +- {now['se']:.4f}" if now["se"] is not None else "")
                    + f", vs best (epoch {top['epoch']:g}) {sign * now['vs_best']:+.4f}"
                    + (f" +- {now['vs_best_se']:.4f}" if now["vs_best_se"] is not None else "")
                    + f": {'chosen' if now['chosen'] else 'not chosen'} ({cfg.select})")
        if now["chosen"]:  # the rule chose this epoch (the best one, or one within noise of it, later)
            state.best_score, state.best_epoch, state.bad_epochs = score, epoch + 1, 0
            if acc.is_main_process:
                save_model_state(acc.unwrap_model(model), ckpt_dir / "best")
        elif finished_epoch:
            state.bad_epochs += 1
        state.history.append(row)
        acc.print(f"{desc} epoch {row['epoch']:.2f}: " + " ".join(f"{k}={v:.4f}" for k, v in row.items()
                                                                 if isinstance(v, float) and k != "epoch")
                  + f" lr={state.lrs[-1]:.2e}" + note)
        if finished_epoch:
            state.epoch, state.batch = epoch + 1, 0
        if acc.is_main_process:
            save_checkpoint(ckpt_dir / "last", acc.unwrap_model(model), optimizer, scheduler, state.to_json())
        acc.wait_for_everyone()
        if cfg.patience > 0 and state.bad_epochs >= cfg.patience:
            stopped = "patience"
        elif stopped == "epochs" and over_budget():
            stopped = "max_minutes"

    acc.wait_for_everyone()
    best = acc.unwrap_model(model)
    if (ckpt_dir / "best").is_dir():
        load_model_state(best, ckpt_dir / "best")
    best.eval()
    result = FitResult(
        epochs=state.epoch, steps=state.step, best_epoch=state.best_epoch,
        best_score=state.best_score, score_name=score_name, stopped=stopped,
        seconds=time.monotonic() - start,
        train_tokens_per_s=state.train_tokens / max(state.train_seconds, 1e-9),
        history=state.history, schedule_epochs=schedule_epochs, budget_plan=budget_plan,
        selection=_selection(state.scores, cfg.select) if state.scores else [],
        lrs=list(state.lrs),
    )
    return best, result


def cosine_schedule(optimizer, steps_per_epoch: int, schedule_epochs: int, warmup: float):
    """Linear warmup then cosine decay over ``schedule_epochs`` epochs of ``steps_per_epoch`` optimizer steps
    (``warmup`` < 1: a fraction of all steps; >= 1: steps). A run stopped before the schedule's end (the scratch
    refit: ``TrainConfig.stop_after``) has had the same learning rates, step for step, as the whole run."""
    from transformers import get_cosine_schedule_with_warmup

    total_steps = steps_per_epoch * schedule_epochs
    steps = int(warmup * total_steps) if warmup < 1 else int(warmup)
    return get_cosine_schedule_with_warmup(optimizer, steps, max(total_steps, 1))


def _selection(scores: list[dict[str, Any]], rule: str) -> list[dict[str, Any]]:
    """training.target_lm.selection.selection_table over the loop state's per-evaluation scores."""
    return selection_table([s["epoch"] for s in scores], [s["score"] for s in scores],
                           [s["per_user"] for s in scores], rule)


def _saved_state(ckpt_dir: Path) -> dict[str, Any]:
    """The loop state of the checkpoint in ``ckpt_dir`` ({} without one)."""
    path = ckpt_dir / "last" / "state.json"
    return json.loads(path.read_text())["state"] if path.is_file() else {}


def _saved_budget_plan(ckpt_dir: Path) -> dict[str, Any] | None:
    """The --fit-budget plan a checkpoint was trained under (a resumed run keeps its schedule), or None."""
    return _saved_state(ckpt_dir).get("budget_plan")



# ------------------------------------------------------------------------------------ checkpoints (no pickles)
# DIR/model.safetensors: the trained module's full state_dict (plain or peft-wrapped model)
# DIR/optimizer.safetensors: optimizer state tensors, keys "<param index>.<name>" (+ "__rng__.cpu")
# DIR/state.json: loop state, optimizer scalars + param groups, scheduler state


def save_model_state(model, path: Path) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))


def load_model_state(model, path: Path) -> None:
    from safetensors.torch import load_file

    file = path / "model.safetensors"
    if not file.is_file():
        raise UserError(f"checkpoint {path} has no model.safetensors")
    model.load_state_dict(load_file(str(file)), strict=True)


def flatten_optimizer_state(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``optimizer.state_dict()`` -> (tensors for safetensors, JSON-able rest).

    >>> # {"state": {0: {"step": t0, "exp_avg": t1}}, "param_groups": [...]} -> ({"0.step": t0, "0.exp_avg": t1},
    >>> #  {"param_groups": [...], "scalars": {}})
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for pid, st in sd["state"].items():
        for name, value in st.items():
            key = f"{pid}.{name}"
            if torch.is_tensor(value):
                tensors[key] = value.detach().to("cpu").contiguous()
            else:
                scalars[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(path: Path, model, optimizer, scheduler, state: dict[str, Any]) -> None:
    """Write into ``path``.tmp, then swap it in: an interrupted save keeps the previous checkpoint."""
    from safetensors.torch import save_file

    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model_state(model, tmp)
    tensors, opt_meta = flatten_optimizer_state(optimizer.state_dict())
    tensors["__rng__.cpu"] = torch.get_rng_state()
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    payload = {"state": state, "optimizer": opt_meta, "scheduler": scheduler.state_dict()}
    (tmp / "state.json").write_text(json.dumps(payload, indent=1))
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict[str, Any]:
    """Restore model / optimizer / scheduler / RNG from ``path``; returns the loop state."""
    from safetensors.torch import load_file

    payload = json.loads((path / "state.json").read_text())
    load_model_state(model, path)
    tensors = load_file(str(path / "optimizer.safetensors"))
    torch.set_rng_state(tensors.pop("__rng__.cpu"))
    optimizer.load_state_dict(unflatten_optimizer_state(tensors, payload["optimizer"]))
    scheduler.load_state_dict(payload["scheduler"])
    return payload["state"]


# ------------------------------------------------------------------------------------ the bundle stages


def _best_entry(result: FitResult) -> dict[str, float | str]:
    """``{"metric": "recall@10", "value": 0.012}`` or ``{"metric": "valid_loss", "value": 4.1}``."""
    if result.score_name.startswith("-"):
        return {"metric": result.score_name[1:], "value": -result.best_score}
    return {"metric": result.score_name, "value": result.best_score}


def ensure_tokenizer(bundle, data, base_model: str | Path | None = None, vocab_size: int | None = None):
    """The bundle's tokenizer, built on first use (our BPE on prompt + item texts, or the base model's)."""
    from recsvc.bundle.prompt import TEMPLATES
    from recsvc.bundle.tokenizer import (
        DEFAULT_TEXT_VOCAB,
        code_token_offset,
        from_base_model,
        tokenizer_texts,
        train_tokenizer,
    )

    source = str(Path(base_model).resolve()) if base_model else None
    if bundle.is_done("tokenizer"):
        built_from = bundle.stage_info("tokenizer").get("base_model")
        if built_from != source:
            raise UserError(f"bundle {bundle.root} has a tokenizer built from {built_from or 'its own BPE'}, "
                            f"not {source or 'its own BPE'}: use a new bundle")
        return bundle.load_tokenizer()
    t0 = time.monotonic()
    if base_model:
        tok = from_base_model(base_model)
    else:
        texts = tokenizer_texts((m.text() for m in data.items.values()), TEMPLATES)
        tok = train_tokenizer(texts, vocab_size or DEFAULT_TEXT_VOCAB)
    tok.save_pretrained(str(bundle.tokenizer_dir))
    bundle.mark_done("tokenizer", seconds=round(time.monotonic() - t0, 2), vocab_size=len(tok),
                     code_offset=code_token_offset(tok), base_model=source)
    return tok


def train_target(
    data_dir: str | Path,
    bundle_dir: str | Path,
    preset: str = "small",
    cfg: TrainConfig | None = None,
    evaluator: Evaluator | None = None,
    base_model: str | Path | None = None,
    lora=None,  # training.target_lm.lora.LoraSettings | None (with base_model)
    force: bool = False,
    eval_max_users: int | None = 2000,
    max_history: int | None = None,
    window_stride: int = 1,
    make_evaluator: Callable[[Any, Any], Evaluator] | None = None,
    prompt_header: str = "lcrec",
    protocol: str = "paper",
    refit_epochs: int = 1,  # 0: auto (the epoch chosen on valid for scratch, 1 for continue)
    refit_lr: float | None = None,
    refit_mode: str = "continue",
    align: str = "none",
    dense=None,  # recsvc.content.dense_head.DenseSettings | None: train the dense head beside the LM
    prior_loss=None,  # training.target_lm.prior_loss.PriorLossSettings | None: the prior inside the LM loss
) -> dict[str, Any]:
    """The ``target`` stage: train, save the best model to BUNDLE/target, mark the stage done.

    ``protocol``: "paper" trains on the TRAIN period only (the AtSpeed / LC-Rec protocol). "deploy" first does
    the same (the epoch is chosen on valid), then continues the chosen model for ``refit_epochs`` over
    train + valid sequences at peak lr ``refit_lr`` (default lr / 2; ``refit_mode="scratch"``: a fresh model of the
    same shape trained on train + valid at the full lr instead, the classic refit, under the selection run's
    warmup/cosine schedule (sized for its planned epochs) and stopped after ``refit_epochs`` of them, so that the
    served model is trained as the validated epoch was; with ``cfg.epochs == 0`` the selection phase is skipped,
    ``refit_epochs`` comes from an earlier selection run, e.g. a paper-protocol bundle's best epoch, and the
    schedule spans those epochs): a deployed model must know the most
    recent period before it serves the next one. ``dense``: also train the dense head (its loss beside the LM
    loss, over the fitting period's items; saved beside the target, ``recsvc.content.dense_head``). ``prior_loss``:
    the last-item transition prior of each phase's fitting period inside the LM loss
    (``training.target_lm.prior_loss``); the epoch is then chosen with that prior fused into the evaluator's search.
    ``align="text2id"`` adds LC-Rec's text -> id alignment examples
    (``training.target_lm.sequences.alignment_examples``) of the catalog of the period each phase serves: the items
    interacted with by the end of valid for the selection phase, the whole catalog for the deploy refit. The
    prompt header style and history length are recorded in
    bundle.json (``Bundle.prompt_builder`` rebuilds the same prompts for serving and evaluation).

    The epoch is chosen by ``cfg.select`` (``training.target_lm.selection``: the best one, or the latest within one
    paired standard error of it) on ``evaluator(model)["recall@10"]`` when given, else ``make_evaluator(builder, data)``
    (built here from the bundle's PromptBuilder and the SplitData, e.g. a beam-search Recall@10 on
    validation users), else the validation loss.
    """
    from accelerate import PartialState

    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.presets import get_preset, new_model
    from recsvc.bundle.prompt import MAX_HISTORY, PromptBuilder
    from recsvc.data.split import load_split_dir
    from training.target_lm.lora import is_peft, load_base_model, merge_lora, wrap_lora
    from training.target_lm.prior_loss import fusion_for
    from training.target_lm.sequences import alignment_examples, count_tokens, eval_examples, train_examples

    cfg = cfg or TrainConfig()
    if align not in ALIGN_MODES:
        raise UserError(f"align must be one of {', '.join(ALIGN_MODES)}, not {align!r}")
    if protocol not in PROTOCOLS:
        raise UserError(f"protocol must be {' or '.join(PROTOCOLS)}, not {protocol!r}")
    if refit_mode not in REFIT_MODES:
        raise UserError(f"refit mode must be {' or '.join(REFIT_MODES)}, not {refit_mode!r}")
    if cfg.epochs < 1 and not (protocol == "deploy" and refit_mode == "scratch"):
        raise UserError("--epochs 0 (no selection phase) needs --protocol deploy --refit scratch")
    if refit_epochs == 0 and cfg.epochs < 1:
        raise UserError("--refit-epochs auto takes the epoch count chosen on valid: it needs --epochs >= 1")
    dist = PartialState(cpu=not torch.cuda.is_available())
    main_process = dist.is_main_process
    log = print if main_process else (lambda *a, **k: None)
    if lora is not None and not base_model:
        raise UserError("--lora needs --base-model PATH (a local pretrained checkpoint)")
    data = load_split_dir(data_dir)
    with dist.main_process_first():  # the main process creates the bundle / tokenizer, the others read them
        bundle = Bundle.create(bundle_dir, data=data_dir)
        ckpt = bundle.checkpoint_dir("target")
        if force and main_process:
            shutil.rmtree(ckpt, ignore_errors=True)
            bundle.clear_stage("target")
        elif not force and (ckpt / "last").is_dir() and not cfg.resume:
            raise UserError(f"{ckpt} holds a checkpoint: pass --resume to continue or --force to start over")
        ids = bundle.load_ids()
        tok = ensure_tokenizer(bundle, data, base_model)
        if main_process:
            bundle.update(prompt={"header": prompt_header, "max_history": max_history or MAX_HISTORY},
                          protocol=protocol)
    builder = PromptBuilder(tok, ids, max_history or MAX_HISTORY, header=prompt_header)
    fusion = fusion_for(builder, data.train.values(), prior_loss)  # None without --prior-loss
    if evaluator is None and make_evaluator is not None:
        evaluator = (make_evaluator(builder, data) if fusion is None else
                     make_evaluator(builder, data, prior=fusion.search_prior()))
    train = train_examples(builder, data.train, stride=window_stride)
    texts = {i: m.text() for i, m in data.items.items()}
    aligned = 0
    if align == "text2id":  # the catalog of the valid period: the items interacted with by its end
        known = {i for seq in data.sequences("train+valid").values() for i in seq}
        extra = alignment_examples(builder, texts, known)
        aligned = len(extra)
        train = train + extra
    valid = eval_examples(builder, data.eval_users("valid"), max_users=eval_max_users, seed=cfg.seed)
    tokens, labelled = count_tokens(train)
    log(f"target: {len(train)} windows, {tokens} tokens ({labelled} labelled, {labelled / max(tokens, 1):.0%}) "
        f"per epoch; {len(valid)} validation examples; prompt header {prompt_header}, protocol {protocol}"
        + (f"; {aligned} text -> id alignment examples" if align != "none" else ""))

    if base_model:
        model = load_base_model(base_model, tok)
        model = wrap_lora(model, lora) if lora is not None else model
        preset_name = f"base-model:{Path(base_model).resolve()}"
    else:
        p = get_preset(preset)
        model = new_model(p, tok, seed=cfg.seed)
        preset_name = p.name
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"target: {preset_name}, {n_params / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trained)")

    dense_items = None
    source: Any = train if fusion is None else prior_source(train, fusion, tok.pad_token_id)
    if fusion is not None:
        log(f"target: the transition prior inside the loss (weight {prior_loss.weight:g}, beta {prior_loss.beta:g}, "
            "leave-one-out counts of train)")
    if dense is not None:
        from training.target_lm.dense_loss import attach_head

        dense_items = catalog_text_embeddings(data_dir, ids)
        attach_head(model, dense_items.shape[1], seed=cfg.seed)
        source = dense_source(train, builder, dense_items, data.sequences("train").values(), dense, tok.pad_token_id,
                              fusion)
        log(f"target: dense head {model.config.hidden_size} -> {dense_items.shape[1]} (weight {dense.weight:g}, "
            f"temperature {dense.temperature:g})")

    best, result = fit_causal_lm(model, source, valid, cfg, ckpt, tok.pad_token_id, evaluator, desc="target")
    refit = None
    if protocol == "deploy":
        if main_process and cfg.epochs > 0:  # the train-only model: validation-time tuning and paper-protocol figures
            import copy

            train_only = copy.deepcopy(best)
            save_target(merge_lora(train_only) if is_peft(train_only) else train_only, bundle.train_only_target_dir,
                        dense_items, dense, known_rows(ids, data.sequences("train").values()), ids.item_ids.tolist())
        if refit_epochs == 0:  # auto: the chosen epoch count (scratch), one more epoch (continue)
            refit_epochs = max(1, result.best_epoch) if refit_mode == "scratch" else 1
        # scratch: the selection run's schedule (its planned epochs), stopped after the chosen epoch: the served
        # model is trained as the validated one was; without a selection phase (--epochs 0) it spans refit_epochs
        schedule = max(result.schedule_epochs, refit_epochs) if cfg.epochs > 0 else refit_epochs
        if refit_mode == "scratch":
            best = load_base_model(base_model, tok) if base_model else new_model(get_preset(preset), tok, seed=cfg.seed)
            best = wrap_lora(best, lora) if (base_model and lora is not None) else best
            refit_lr = refit_lr if refit_lr is not None else cfg.lr
            if dense is not None:
                from training.target_lm.dense_loss import attach_head

                attach_head(best, dense_items.shape[1], seed=cfg.seed)
        best, refit = _refit(best, builder, data, cfg, ckpt / "refit", tok.pad_token_id, window_stride,
                             refit_epochs, refit_lr, log, schedule if refit_mode == "scratch" else refit_epochs,
                             alignment_examples(builder, texts, data.items) if align == "text2id" else [],
                             dense=None if dense is None else (builder, dense_items, dense), prior_loss=prior_loss)
        refit["mode"] = refit_mode
    info = {
        "seconds": round(result.seconds, 1), "preset": preset_name, "params": n_params,
        "epochs": result.epochs, "schedule_epochs": result.schedule_epochs, "budget_plan": result.budget_plan,
        "steps": result.steps, "best_epoch": result.best_epoch,
        "best": _best_entry(result), "stopped": result.stopped, "select": cfg.select,
        "selection": result.selection, "lr_by_epoch": result.lrs,
        "train_tokens_per_s": round(result.train_tokens_per_s, 1), "tokens_per_epoch": tokens,
        "labelled_tokens_per_epoch": labelled, "prompt_header": prompt_header, "protocol": protocol,
        "refit": refit, "align": align, "align_examples": aligned,
        "dense_head": asdict(dense) if dense is not None else None,
        "lora": asdict(lora) if lora is not None else None, "window_stride": window_stride,
        "prior_loss": asdict(prior_loss) if prior_loss is not None else None,
        "config": asdict(cfg), "main_process": main_process,
    }
    if main_process:
        final = merge_lora(best) if is_peft(best) else best
        save_target(final, bundle.target_dir, dense_items, dense,
                    known_rows(ids, data.sequences("train+valid" if protocol == "deploy" else "train").values()),
                    ids.item_ids.tolist())
        (bundle.target_dir / "training.json").write_text(
            json.dumps({**info, "history": result.history}, indent=1, default=str))
        bundle.update(target_preset=preset_name, protocol=protocol)
        bundle.mark_done("target", **{k: v for k, v in info.items() if k != "config"})
    return info


def _refit(model, builder, data, cfg: TrainConfig, ckpt: Path, pad_id: int, window_stride: int, epochs: int,
           lr: float | None, log, schedule_epochs: int, extra: list | None = None, dense=None, prior_loss=None
           ) -> tuple[Any, dict[str, Any]]:
    """The deployment protocol's second phase: train ``model`` over train + valid sequences for ``epochs`` epochs
    of a warmup/cosine schedule spanning ``schedule_epochs`` (no selection: the valid period is now training data;
    the epoch count was chosen before), plus ``extra`` examples (the alignment task's). Resumable (``ckpt``)."""
    from dataclasses import replace

    from training.target_lm.sequences import count_tokens, train_examples

    examples = train_examples(builder, data.sequences("train+valid"), stride=window_stride) + list(extra or [])
    tokens, labelled = count_tokens(examples)
    rcfg = replace(cfg, epochs=schedule_epochs, stop_after=epochs, lr=lr if lr is not None else cfg.lr / 2,
                   patience=0, resume=(ckpt / "last" / "state.json").is_file(), max_minutes=None, fit_budget=False)
    log(f"refit (deploy protocol): {len(examples)} windows, {tokens} tokens ({labelled} labelled) per epoch, "
        f"{epochs} epoch(s) of a {schedule_epochs}-epoch schedule at peak lr {rcfg.lr:g}")
    from training.target_lm.prior_loss import fusion_for

    model.train()
    fusion = fusion_for(builder, data.sequences("train+valid").values(), prior_loss)  # the prior counts train + valid
    source: Any = examples if fusion is None else prior_source(examples, fusion, pad_id)
    if dense is not None:  # (builder, item embeddings, settings): the head over train + valid's items
        source = dense_source(examples, dense[0], dense[1], data.sequences("train+valid").values(), dense[2], pad_id,
                              fusion)
    best, result = fit_causal_lm(model, source, [], rcfg, ckpt, pad_id, None, desc="refit")
    return best, {"epochs": result.epochs, "schedule_epochs": result.schedule_epochs, "lr": rcfg.lr,
                  "lr_by_epoch": result.lrs, "extra_examples": len(extra or []),
                  "seconds": round(result.seconds, 1),
                  "tokens_per_epoch": tokens, "train_tokens_per_s": round(result.train_tokens_per_s, 1)}


def catalog_text_embeddings(data_dir: str | Path, ids) -> torch.Tensor:
    """[n, D] every catalog item's text embedding (the one its semantic id was made from), in ``ids``' row order."""
    from recsvc.content.dense_head import item_embeddings
    from training.data.item_vectors import item_vectors

    vectors = item_vectors(Path(data_dir))
    return item_embeddings(ids.item_ids, dict(zip(vectors.item_ids.tolist(), vectors.vectors, strict=True)),
                           vectors.vectors.shape[1])


def dense_source(examples: Sequence[Example], builder, items: torch.Tensor, sequences, settings, pad_id: int,
                 fusion=None) -> BatchSource:
    """The windows trained with the LM loss + the dense head's (``training.target_lm.dense_loss.DenseLoss``), its
    softmax over the items of ``sequences`` (the fitting period's); ``fusion``: the prior inside the LM loss."""
    from training.target_lm.dense_loss import DenseLoss

    loss = DenseLoss(builder, items, known_rows(builder.ids, sequences), settings, fusion)
    return BatchSource([len(e) for e in examples], lambda idx: collate([examples[i] for i in idx], pad_id), loss)


def prior_source(examples: Sequence[Example], fusion, pad_id: int) -> BatchSource:
    """The windows trained with the prior inside the LM loss (``training.target_lm.prior_loss.PriorFusion``)."""
    from dataclasses import replace

    return replace(BatchSource.windows(examples, pad_id), loss=partial(lm_loss, fusion=fusion))


def known_rows(ids, sequences) -> set[int]:
    """The rows of the items of ``sequences`` (a fitting period's): the items a target trained on them knows."""
    return {ids.index_of(i) for seq in sequences for i in seq if i in ids}


def save_target(model, directory: Path, dense_items: torch.Tensor | None, dense, known: set[int] | None = None,
                item_ids: Sequence[int] | None = None) -> None:
    """The causal LM to ``directory``; its dense head (taken off the model) beside it when it has one."""
    from recsvc.bundle.loading import save_causal_lm
    from recsvc.content.dense_head import save_dense_head
    from training.target_lm.dense_loss import detach_head

    head = detach_head(model)
    save_causal_lm(model, directory)
    if head is not None and dense_items is not None and dense is not None:
        save_dense_head(directory, head, dense_items, dense, sorted(known or ()), item_ids)
        model.dense_head = head  # the caller's model keeps its head
