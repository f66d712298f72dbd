"""``recsvc build``: make a servable bundle from a data directory, stage by stage, resumable.

    recsvc build --data data/beauty --out artifacts/beauty --preset small --max-minutes 50
    recsvc build --recipe served --data data/beauty --out artifacts/beauty/bundle \
        --ids artifacts/beauty/ids/semantic_ids.json [--from STAGE] [--to STAGE] [--set [STAGE.]FIELD=VALUE ...]

Stages (each recorded in BUNDLE/bundle.json when finished; a finished stage is skipped on re-runs, an
interrupted training stage resumes from its checkpoint):

    ids        item texts -> RQ-VAE -> collision-free semantic ids (tokenizer_rqvae.build), or --ids FILE
    tokenizer  text BPE + 1024 code tokens (or --base-model's tokenizer)
    target     the LC-Rec style target LM (training.target_lm.train)

then what serving reads of the data (BUNDLE/popularity.json, BUNDLE/calibration_histories.json:
recsvc.bundle.serving_files), so a deployed bundle never reads its training data directory.

``--recipe NAME`` runs a whole recipe instead (training/recipe: the served one is the ids, this build, every
tuning and the draft head), or the range ``--from``/``--to`` of its stages, each parameter as the recipe defines it
unless ``--set`` overrides it; finished stages are recorded in bundle.json and skipped on re-runs
(training/recipe/runner.py). ``--dry-run`` prints the stages' commands and which of them would run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from recsvc.errors import UserError
from training.cli import add_loop_args, add_model_args
from training.ids.stage import stage_ids
from training.target_lm.settings import evaluator_factory, loop_config, lora_settings, target_settings

STAGES = ("ids", "tokenizer", "target")


def register(subparsers) -> None:
    p = subparsers.add_parser("build", help="build a bundle (ids, tokenizer, target) from a data directory")
    p.add_argument("--data", type=Path, required=True, help="split data directory")
    p.add_argument("--out", type=Path, required=True, help="bundle directory (created or resumed)")
    p.add_argument("--ids", type=Path, default=None,
                   help="use this semantic_ids.json instead of training the RQ-VAE (e.g. the reference ids)")
    p.add_argument("--drafter-preset", default=None,
                   help="also train a drafter of this preset (stage 'drafter', SFT; e.g. drafter-small)")
    p.add_argument("--drafter-epochs", type=int, default=None, help="drafter epochs (default: --epochs)")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES))
    p.add_argument("--plan", action="store_true",
                   help="instead of training the target: count an epoch's tokens (and labelled share), time "
                        "--plan-steps real training steps, print minutes per epoch and the epochs that fit "
                        "--max-minutes (also written to BUNDLE/plan.json)")
    p.add_argument("--plan-steps", type=int, default=20, help="timed training steps of --plan")
    add_model_args(p)
    add_loop_args(p)
    add_recipe_args(p)
    # what --recipe refuses beside it: every other flag's default, as (option, default) by dest
    p.set_defaults(func=cmd_build, build_flag_defaults={
        a.dest: (a.option_strings[0], a.default) for a in p._actions
        if a.option_strings and a.dest not in RECIPE_DESTS and a.dest != "help"})


RECIPE_DESTS = ("recipe", "from_stage", "to_stage", "settings", "dry_run", "data", "out", "ids")


def add_recipe_args(p: argparse.ArgumentParser) -> None:
    from training.recipe.recipes import RECIPES

    p.add_argument("--recipe", choices=tuple(RECIPES), default=None,
                   help="run this recipe's stages (served: ids, target, the tunings, the draft head) instead of the "
                        "build alone; --ids names the ids file its ids stage writes (or that exists)")
    p.add_argument("--from", dest="from_stage", default=None, metavar="STAGE",
                   help="--recipe: the first stage run (default: the recipe's first)")
    p.add_argument("--to", dest="to_stage", default=None, metavar="STAGE",
                   help="--recipe: the last stage run (default: the recipe's last)")
    p.add_argument("--set", dest="settings", action="extend", nargs="+", default=[], metavar="[STAGE.]FIELD=VALUE",
                   help="--recipe: override a stage's parameter (without STAGE: every stage that has FIELD), e.g. "
                        "target.seed=2 threads=1")
    p.add_argument("--dry-run", action="store_true", help="--recipe: print the stages' commands, run nothing")


def plan_target(args: argparse.Namespace, bundle, data, cfg) -> str:
    """The ``--plan`` report for the target stage's settings (see training/target_lm/epoch_plan.py); writes
    BUNDLE/plan.json."""
    import torch

    from recsvc.bundle.presets import get_preset, new_model
    from recsvc.bundle.prompt import MAX_HISTORY, PromptBuilder
    from training.target_lm.epoch_plan import epoch_plan, probe_tokens_per_s, render_plan
    from training.target_lm.sequences import alignment_examples, train_examples
    from training.target_lm.train import ensure_tokenizer

    if args.plan_steps < 1:
        raise UserError(f"--plan-steps must be >= 1, got {args.plan_steps}")
    if args.base_model:
        raise UserError("--plan times the presets trained from scratch; drop --base-model")
    settings = target_settings(args)
    tok = ensure_tokenizer(bundle, data, None)
    builder = PromptBuilder(tok, bundle.load_ids(), settings["max_history"] or MAX_HISTORY,
                            header=settings["prompt_header"])
    selection = train_examples(builder, data.train, stride=args.window_stride)
    refit = (train_examples(builder, data.sequences("train+valid"), stride=args.window_stride)
             if settings["protocol"] == "deploy" else None)
    if settings["align"] == "text2id":  # the alignment task's examples, as train_target adds them
        texts = {i: m.text() for i, m in data.items.items()}
        selection += alignment_examples(builder, texts, {i for s in data.sequences("train+valid").values() for i in s})
        refit = refit + alignment_examples(builder, texts, data.items) if refit is not None else None
    model = new_model(get_preset(args.preset), tok, seed=cfg.seed)
    fit = None
    if cfg.max_minutes:  # what --fit-budget would plan: the same probe, plus one timed validation pass
        fit = plan_fit_budget(args, cfg, model, builder, data, selection, tok.pad_token_id)
        rate = fit["train_tokens_per_s"] or float("nan")
    else:
        rate = probe_tokens_per_s(model, selection, cfg, tok.pad_token_id, args.plan_steps)
    plan = epoch_plan(selection, refit, rate, cfg.max_minutes, cfg.epochs)
    if fit is not None:
        plan["fit_budget"] = fit
    plan.update(preset=args.preset, prompt=settings["prompt_header"], window_stride=args.window_stride,
                align=settings["align"],
                batch_size=cfg.batch_size, threads=torch.get_num_threads(), probe_steps=args.plan_steps)
    (bundle.root / "plan.json").write_text(json.dumps(plan, indent=1))
    return render_plan(plan, cfg.epochs, cfg.max_minutes)


def plan_fit_budget(args: argparse.Namespace, cfg, model, builder, data, selection, pad_id: int) -> dict:
    """training.target_lm.budget.plan_schedule for the run these flags describe (the --fit-budget plan, before
    training)."""
    import torch

    from training.target_lm.budget import plan_schedule
    from training.target_lm.sequences import collate, eval_examples
    from training.target_lm.train import lm_loss, resolve_bf16, validation_pass

    cpu = torch.device("cpu")
    bf16 = resolve_bf16(cfg.bf16, cpu)
    valid = eval_examples(builder, data.eval_users("valid"), max_users=args.eval_users, seed=cfg.seed)
    make_eval = evaluator_factory(args)
    one_pass = validation_pass(valid, pad_id, cfg, cpu, bf16, make_eval(builder, data) if make_eval else None)
    return plan_schedule(model, lambda idx: collate([selection[i] for i in idx], pad_id), lm_loss,
                         [len(e) for e in selection], cfg.batch_size, 1, cfg.lr, cfg.weight_decay, bf16, one_pass,
                         cfg.max_minutes, 0.0, max(cfg.epochs, 1), steps=args.plan_steps, seed=cfg.seed)


def cmd_recipe(args: argparse.Namespace) -> int:
    """``recsvc build --recipe NAME``: the recipe's stages from --from through --to, resumed."""
    from training.recipe.recipes import override, recipe, select
    from training.recipe.runner import run_recipe
    from training.recipe.stages import RecipePaths

    given = [option for dest, (option, default) in args.build_flag_defaults.items()
             if getattr(args, dest, default) != default]
    if given:
        raise UserError(f"--recipe sets the build's flags itself: drop {', '.join(given)} (override a stage's "
                        "parameter with --set STAGE.FIELD=VALUE, e.g. --set target.seed=2)")
    if not args.data.is_dir():
        raise UserError(f"data directory not found: {args.data}")
    stages = select(override(recipe(args.recipe), args.settings), args.from_stage, args.to_stage)
    if args.ids is None and any(s.name == "ids" for s in stages):
        raise UserError("the recipe's ids stage writes the semantic ids: give --ids DIR/semantic_ids.json")
    run_recipe(stages, RecipePaths(args.data, args.out, args.ids), label=args.recipe, dry_run=args.dry_run)
    print(f"bundle: {args.out}")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from recsvc.bundle.directory import Bundle
    from recsvc.data.split import load_split_dir
    from training.target_lm.train import ensure_tokenizer, train_target

    if args.recipe:
        return cmd_recipe(args)
    if args.from_stage or args.to_stage or args.settings or args.dry_run:
        raise UserError("--from, --to, --set and --dry-run go with --recipe NAME")
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise UserError(f"unknown stage(s) {', '.join(unknown)}: expected a subset of {', '.join(STAGES)}")
    if not args.data.is_dir():
        raise UserError(f"data directory not found: {args.data}")
    cfg = loop_config(args)
    lora = lora_settings(args)
    bundle = Bundle.create(args.out, data=args.data)
    data = None
    for stage in stages:
        if bundle.is_done(stage) and not (args.force and stage == "target"):
            print(f"[{stage}] done earlier, skipped")
            continue
        t0 = time.monotonic()
        print(f"[{stage}] running")
        if stage == "ids":
            info = stage_ids(bundle, args.data, args.ids)
        elif stage == "tokenizer":
            data = data or load_split_dir(args.data)
            tok = ensure_tokenizer(bundle, data, args.base_model)
            info = {"vocab_size": len(tok)}
        elif args.plan:
            data = data or load_split_dir(args.data)
            print(plan_target(args, bundle, data, cfg))
            continue
        else:
            if not bundle.semantic_ids_path.is_file():
                raise UserError(f"the target stage needs semantic ids: run the ids stage first ({bundle.root})")
            ckpt_exists = (bundle.checkpoint_dir("target") / "last").is_dir()
            cfg.resume = cfg.resume or (ckpt_exists and not args.force)  # build always resumes
            info = train_target(args.data, bundle.root, preset=args.preset, cfg=cfg, base_model=args.base_model,
                                lora=lora, force=args.force, eval_max_users=args.eval_users,
                                window_stride=args.window_stride, make_evaluator=evaluator_factory(args),
                                **target_settings(args))
            info = {k: v for k, v in info.items() if k not in ("config", "main_process")}
        print(f"[{stage}] finished in {time.monotonic() - t0:.1f}s: {json.dumps(info, default=str)}")
    if args.drafter_preset and not args.plan:
        from dataclasses import replace

        from training.drafters.train import train_drafter

        if bundle.is_done("drafter") and not args.force:
            print("[drafter] done earlier, skipped")
        else:
            t0 = time.monotonic()
            print(f"[drafter] running ({args.drafter_preset}, sft)")
            dcfg = replace(cfg, epochs=args.drafter_epochs or cfg.epochs,
                           resume=(bundle.checkpoint_dir("drafter") / "last").is_dir() and not args.force)
            info = train_drafter(bundle.root, args.data, args.drafter_preset, "sft", dcfg, args.eval_users,
                                 args.window_stride, args.force)
            info = {k: v for k, v in info.items() if k != "config"}
            print(f"[drafter] finished in {time.monotonic() - t0:.1f}s: {json.dumps(info, default=str)}")
    if not args.plan and bundle.semantic_ids_path.is_file() and bundle.is_done("target"):
        from recsvc.bundle.serving_files import write_serving_files

        # what serving reads of the data, inside the bundle (a servable bundle: one with a target): it never opens
        # this data directory
        report = write_serving_files(bundle.root, data or load_split_dir(args.data))
        print(f"[serving files] {json.dumps(report)}")
    print(f"bundle: {bundle.root}")
    return 0
