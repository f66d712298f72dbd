"""The stages of `make gpu-bench` that load the bundle again (``recsvc.bench.gpu_accept``): strict against plain in
fp32, the compiled-graphs forward against graphs, and the recommender as served."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from recsvc.bench.gpu_inputs import engines, load


def lossless_fp32(bundle: Path, cfg: dict, device: str, forward: str, deadline: float, emit) -> None:
    """Strict speculation against plain decoding with the target and drafter in fp32 on the same device: the
    lossless claim without bf16 near-ties (in bf16 the kernels' sums depend on the batch shape)."""
    from recsvc.engine.cuda_graphs import warm_up
    from recsvc.engine.decode import decode

    if time.perf_counter() > deadline:
        return
    k, width = cfg["k"], cfg["width"]
    _, target, engine, drafter, _, prompts, inputs = load(bundle, cfg, device, forward, "fp32")

    def plain(pb):
        hist, prior = inputs.of(pb)
        return decode(engine, None, pb, hist, "plain", width, (0, 0), prior=prior, top=k)

    def strict(pb):
        hist, prior = inputs.of(pb)
        return decode(engine, drafter, pb, hist, "strict", width, (cfg["n"], cfg["gamma"]), prior=prior)

    warm_up(engines(target, drafter), [lambda pb=pb: (plain(pb), strict(pb)) for pb in prompts],
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
    ctx, target, engine, drafter, drafter_label, prompts, inputs = load(bundle, cfg, device, "compiled-graphs",
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
    warm = warm_up([*engines(target, drafter), graphs.model],
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
                    "runners": [m.graph_runner.summary() for m in engines(target, drafter) if m.graph_runner]})
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
