"""The stages of `make gpu-bench` that load the bundle again (``bench.gpu_accept``): strict against plain in
fp32, the compiled-graphs forward against graphs, and the recommender as served."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from bench.gpu_inputs import device_name, engines, load, plain_search, strict_search, timed


def lossless_fp32(bundle: Path, cfg: dict, device: str, forward: str, deadline: float, emit) -> None:
    """Strict speculation against plain decoding with the target and drafter in fp32 on the same device: the
    lossless claim without bf16 near-ties (in bf16 the kernels' sums depend on the batch shape)."""
    from recsvc.engine.kernels.cuda_graphs import warm_up

    if time.perf_counter() > deadline:
        return
    k, width, spec = cfg["k"], cfg["width"], (cfg["n"], cfg["gamma"])
    loaded = load(bundle, cfg, device, forward, "fp32")
    target, engine, drafter, requests = loaded.target, loaded.engine, loaded.drafter, loaded.requests

    def plain(req):
        return plain_search(engine, req, width, k)

    def strict(req):
        return strict_search(engine, drafter, req, width, spec)

    warm_up(engines(target, drafter), [lambda req=req: (plain(req), strict(req)) for req in requests],
            cfg["warmup_seconds"] / 3)
    same = [torch.equal(strict(req).leaves[0, :k], plain(req).leaves[0]) for req in requests
            if time.perf_counter() < deadline]
    if same:
        emit("lossless_fp32", {"device": device_name(device),
                               "precision": "float32", "forward": target.forward_name, "k": k, "width": width,
                               "users": len(same), "same_lists": sum(same), "same_share": sum(same) / len(same)})


def compiled_forward(bundle: Path, cfg: dict, device: str, deadline: float, emit) -> None:
    """The "compiled-graphs" forward (each decoder layer one ``torch.compile`` graph, replayed in the buckets'
    CUDA graphs: ``recsvc.engine.kernels.compiled_layer``) against "graphs" over the same bf16 target, one request at a
    time, alternating: plain ms per request, the same lists, compile + capture seconds; then strict with the
    target and the drafter compiled."""
    from recsvc.engine.kernels.cuda_graphs import warm_up
    from recsvc.engine.kernels.engine_model import EngineModel
    from recsvc.engine.search.beam_search import BeamSearch

    if time.perf_counter() > deadline:
        return
    k, width, spec = cfg["k"], cfg["width"], (cfg["n"], cfg["gamma"])
    loaded = load(bundle, cfg, device, "compiled-graphs", "auto")
    ctx, target, engine, drafter = loaded.ctx, loaded.target, loaded.engine, loaded.drafter
    drafter_label, requests = loaded.drafter_label, loaded.requests
    graphs = BeamSearch(EngineModel.build(ctx.model, "fp32", forward="graphs"), ctx.trie, ctx.builder.code_offset)
    label = {"device": device_name(device),
             "precision": str(ctx.model.dtype).removeprefix("torch."), "forward": target.forward_name,
             "baseline_forward": graphs.model.forward_name, "drafter": drafter_label, "k": k, "width": width}

    def plain(req, eng):
        return plain_search(eng, req, width, k)

    def strict(req):
        return strict_search(engine, drafter, req, width, spec)

    t0 = time.perf_counter()
    warm = warm_up([*engines(target, drafter), graphs.model],
                   [lambda req=req: (plain(req, engine), plain(req, graphs), strict(req)) for req in requests],
                   cfg["compile_seconds"])
    layer = target.fast().compiled_layer
    res = {**label, "warmup": warm, "compile_and_capture_s": round(time.perf_counter() - t0, 1),
           "layer_failed": layer.failed if layer is not None else "no compiled layer"}
    emit("compiled", res)
    rows = []
    for req in requests:
        if time.perf_counter() > deadline:
            break
        ref, ms_g = timed(lambda req=req: plain(req, graphs), device)
        out, ms_c = timed(lambda req=req: plain(req, engine), device)
        fast, ms_s = timed(lambda req=req: strict(req), device)
        rows.append((ms_g, ms_c, ms_s, torch.equal(out.leaves, ref.leaves), torch.equal(fast.leaves[0, :k],
                                                                                        out.leaves[0])))
    if rows:
        g, c, s = (statistics.mean(r[i] for r in rows) for i in range(3))
        res.update({"users": len(rows), "graphs_ms": g, "compiled_ms": c, "speedup": g / c, "strict_ms": s,
                    "strict_WS_vs_compiled_plain": c / s, "same_as_graphs": sum(r[3] for r in rows) / len(rows),
                    "strict_same_as_plain": sum(r[4] for r in rows) / len(rows),
                    "runners": [m.graph_runner.summary() for m in engines(target, drafter) if m.graph_runner]})
        emit("compiled", res)


def served(bundle: Path, cfg: dict, device: str, forward: str, deadline: float, emit) -> None:
    """The served path on this device: ``BundleRecommender.from_bundle`` with the bundle's own settings (history
    rule, fused prior, dense head, fresh slots, draft head, beam width), warmed up, then one request at a time,
    plain, strict and relaxed (seeded), K = 10: ms per request, and the engine's phases (device synchronised) beside
    the rest (prompts, prior, dense head, fresh slots). Each measured user's first request (``ms_first``: nothing of the
    user cached; validation users ran first, so the prompt shapes have been seen) and its repeat
    (``ms_per_request``: the user-state cache's hit, a returning user)."""
    from bench.gpu_measure import PhaseOps
    from recsvc.bundle.directory import Bundle
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir
    from recsvc.engine.meters.host_reads import HostReads
    from recsvc.engine.meters.launches import Launches
    from recsvc.engine.meters.ledger import SyncedLedger
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
    split = load_split_dir(b.resolve_data_dir(cfg.get("data")))
    users = sample_users(split.eval_users("test"), cfg["users"], 0)
    for u in sample_users(split.eval_users("valid"), 2 * cfg["users"], 0):  # shapes (and graphs) seen first
        if time.perf_counter() > deadline:
            return
        rec.recommend([RecQuery(history=list(u.history), k=cfg["k"], mode="plain")])
    res: dict = {"device": device_name(device), "facts": vars(rec.facts),
                 "forward": rec.target.forward_name, "exclude_history": exclude, "k": cfg["k"],
                 "warm_up_s": round(time.perf_counter() - t0, 1)}
    for mode in ("plain", "strict", "relaxed"):
        rows, first, used, ledger = [], [], set(), SyncedLedger(device)
        launches, calls, by_phase, replays, host_reads = [], [], PhaseOps(), [], []
        for u in users:
            if time.perf_counter() > deadline:
                break
            query = RecQuery(history=list(u.history), k=cfg["k"], mode=mode, seed=0)
            _, ms = timed(lambda query=query: rec.recommend([query]), device)  # strict: the plain pass cached it
            first.append(ms)
            (out,), ms = timed(lambda query=query: rec.recommend([query]), device)
            rows.append(ms)
            used.add(out.decoding.mode if out.decoding is not None else "none")
            rec.recommend([query], ledger=ledger)  # a third run, phases synchronised (not in the ms above)
            with Launches() as ops:  # a fourth: what a GPU launches from Python, by phase
                (out,) = rec.recommend([query], ledger=by_phase.counting(ops))
            with HostReads(rec.target.device) as reads:  # a fifth: the device-to-host reads
                rec.recommend([query])
            launches.append(ops.total)
            replays.append(ops.replays)
            host_reads.append(reads.total)
            calls.append(out.stats.target_calls)
        if rows:
            res[mode] = {"users": len(rows), "ms_first": statistics.mean(first),
                         "ms_per_request": statistics.mean(rows),
                         "ms_median": statistics.median(rows), "decoded": sorted(used),
                         "engine_phases_ms": {k: v / len(rows) for k, v in ledger.ms.items()},
                         "target_calls_per_request": statistics.mean(calls),
                         "eager_ops_per_request": statistics.mean(launches),
                         "replays_per_request": statistics.mean(replays),
                         "host_reads_per_request": statistics.mean(host_reads),
                         "eager_ops_by_phase": {k: v / len(rows) for k, v in by_phase.ops.items()}}
    emit("served", res)
