"""The measured stages of `make gpu-bench` on one loaded bundle (``bench.gpu_accept``'s docstring lists
them): plain vs generate, strict, host reads, phases, batched, relaxed, quality, graphs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from bench.counts import count_requests
from bench.gpu_inputs import device_name, engines, load, plain_search, strict_search, timed, valid_recall


class _Rounds:
    """A ledger counting strict rounds (one "verify" phase each)."""

    def __init__(self) -> None:
        from recsvc.engine.meters.ledger import NO_LEDGER

        self.rounds, self.inner = 0, NO_LEDGER

    def phase(self, name: str):
        self.rounds += name == "verify"
        return self.inner.phase(name)


class PhaseOps:
    """A ledger adding up, per phase, the eager device operations a ``Launches`` counter saw inside it."""

    def __init__(self) -> None:
        from collections import Counter

        self.ops: Counter[str] = Counter()
        self._launches = None

    def counting(self, launches) -> PhaseOps:
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
    """The reads made once at the end of a request, after the search's rounds: its per-row counters turned into
    lists (``recsvc/engine/entry/dispatch.py``; the sync-free strict request's one read,
    ``recsvc/engine/speculation/strict/unrolled.py``)."""
    return sum(c for site, c in reads.by_site.items()
               if site.startswith(("recsvc/engine/entry/dispatch.py:",
                                   "recsvc/engine/speculation/strict/unrolled.py:")))


def measure(bundle: Path, cfg: dict, device: str, forward: str, deadline: float, emit) -> None:
    """Every timed stage on one loaded bundle; ``emit(stage, result)`` records a finished stage."""
    from recsvc.engine.entry.dispatch import decode
    from recsvc.engine.kernels.cuda_graphs import warm_up
    from recsvc.engine.kernels.engine_model import EngineModel
    from recsvc.engine.meters.host_reads import HostReads
    from recsvc.engine.search.beam_search import BeamSearch
    from recsvc.engine.search.reference import generate_topk
    from recsvc.engine.search.sampling import make_generators

    k, width, n, gamma = cfg["k"], cfg["width"], cfg["n"], cfg["gamma"]
    loaded = load(bundle, cfg, device, forward, "auto")
    ctx, target, engine, drafter = loaded.ctx, loaded.target, loaded.engine, loaded.drafter
    drafter_label, requests, inputs = loaded.drafter_label, loaded.requests, loaded.inputs
    off = ctx.builder.code_offset
    engine_eager = BeamSearch(EngineModel.build(ctx.model, "fp32", forward="fast"), ctx.trie, off)
    label = {"device": device_name(device),
             "precision": str(ctx.model.dtype).removeprefix("torch."), "forward": target.forward_name,
             "drafter": drafter_label, "target_valid": valid_recall(bundle),
             "prior": "fused" if inputs.fused is not None else "none", "k": k, "width": width}
    temp = torch.tensor([1.0], device=device)

    def timed_ms(fn):
        return timed(fn, device)

    # every search through the one decoding entry (no exclusions: the measured users' lists are not filtered)
    def plain(req, eng=engine, ledger=None, fuse=True):
        return plain_search(eng, req, width, k, ledger, fuse)

    def strict(req, eng=engine, ledger=None, exit_check=None):
        return strict_search(eng, drafter, req, width, (n, gamma), ledger, exit_check)

    def relaxed(req, seed):
        return decode(engine, drafter, req.pb, req.histories, "relaxed", width, (n, gamma), prior=req.prior,
                      temperatures=temp, generators=make_generators([seed]))

    def sampling(req, seed):  # the target's own sampling beam search (no drafter)
        return decode(engine, None, req.pb, req.histories, "relaxed", width, (0, 0), prior=req.prior,
                      temperatures=temp, generators=make_generators([seed]))

    batch = inputs.request([u.history for u in ctx.users[:cfg["batch"]]])
    # every measured user's searches once (their buckets' graphs captured before any clock runs), then the batch
    searches = [lambda req=req: (plain(req), plain(req, fuse=False), strict(req), relaxed(req, 0), sampling(req, 0))
                for req in requests]
    searches = [lambda: plain(batch), lambda: strict(batch), *searches,
                *[lambda req=req: plain(req, engine_eager, fuse=False) for req in requests[:cfg["calibration"]]]]
    emit("warmup", {**label, **warm_up(engines(target, drafter), searches, cfg["warmup_seconds"])})

    def over() -> bool:
        return time.perf_counter() > deadline

    # plain decoding vs generate
    def stage_plain() -> None:
        rows, same, same_eager = [], 0, 0
        for req in requests:
            if over():
                break
            out, ms = timed_ms(lambda req=req: plain(req, fuse=False))  # generate knows no prior
            eager_out, ms_eager = timed_ms(lambda req=req: plain(req, engine_eager, fuse=False))
            same_eager += torch.equal(out.leaves, eager_out.leaves)  # graphs vs the eager forward (bf16 near-ties)
            (codes, _), ms_gen = timed_ms(lambda req=req: generate_topk(ctx.model, ctx.trie, off,
                                                                        req.pb.ids[0].tolist(), width))
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
        for req in requests:
            if over():
                break
            ref, ms_p = timed_ms(lambda req=req: plain(req))
            out, ms_s = timed_ms(lambda req=req: strict(req))
            early, ms_e = timed_ms(lambda req=req: strict(req, exit_check=1))  # a finished request stops there
            same += torch.equal(out.leaves[0, :k], ref.leaves[0]) and torch.equal(early.leaves, out.leaves)
            ran.add(out.decoding.mode)
            rows.append((ms_p, ms_s, out.target_calls[0], out.accepted[0], ms_e))
        if rows:
            p, s = statistics.mean(r[0] for r in rows), statistics.mean(r[1] for r in rows)
            emit("strict", {**label, "users": len(rows), "N": n, "gamma": gamma, "decoded": sorted(ran),
                            "plain_ms": p, "strict_ms": s,
                            "WS": p / s, "AS": statistics.mean(r[3] for r in rows),
                            "strict_ms_exit_check_1": statistics.mean(r[4] for r in rows),
                            "WS_exit_check_1": p / statistics.mean(r[4] for r in rows),
                            "target_calls": statistics.mean(r[2] for r in rows), "same_lists": same,
                            "same_share": same / len(rows), "differing": len(rows) - same})

    # host reads (counting slows every torch call: separate, untimed runs)
    def stage_host_reads() -> None:
        if not over():
            res = {**label}
            for name, eng in (("sync_free", engine), ("eager_fast", engine_eager)):
                per_round, per_req, at_end, beyond, plain_reads, plain_end = [], [], [], [], [], []
                for req in requests[:5]:
                    rounds = _Rounds()
                    with HostReads(device) as reads:
                        strict(req, eng, rounds)
                    end = _request_end_reads(reads)  # decode's counters made lists once the search is done
                    per_round.append((reads.total - end) / max(rounds.rounds, 1))
                    per_req.append(reads.total)
                    at_end.append(end)
                    beyond.append(max(0, reads.total - end - rounds.rounds))  # the search's reads beyond one per round
                    with HostReads(device) as reads_p:
                        plain(req, eng)
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
        from recsvc.engine.meters.launches import Launches
        from recsvc.engine.meters.ledger import SyncedLedger

        if over():
            return
        res: dict = {**label, "users": min(len(requests), 10)}
        for name, fn in (("plain", plain), ("strict", strict)):
            ledger = SyncedLedger(device)
            launches, replays, by_phase = [], [], PhaseOps()
            for req in requests[:10]:
                fn(req, ledger=ledger)
                with Launches() as ops:
                    fn(req, ledger=by_phase.counting(ops))
                launches.append(ops.total)
                replays.append(ops.replays)
            users = res["users"]
            res[name] = {"ms_per_request": {k: v / users for k, v in ledger.ms.items()},
                         "phase_calls_per_request": {k: v / users for k, v in ledger.calls.items()},
                         "eager_ops_per_request": statistics.mean(launches),
                         "eager_ops_by_phase": {k: v / users for k, v in by_phase.ops.items()},
                         "replayed_forwards_per_request": statistics.mean(replays), "top_ops": ops.summary(8)["by_op"]}
        # per request, on untimed runs of their own: eager device ops, graph replays, host reads (bench.counts)
        few = requests[:5]
        res["per_request"] = {"plain": count_requests([partial(plain, req) for req in few], device),
                              "strict": count_requests([partial(strict, req) for req in few], device),
                              "relaxed": count_requests([partial(relaxed, req, 0) for req in few], device)}
        emit("phases", res)

    # batched vs one at a time
    def stage_batched() -> None:
        if not over():
            singles = [timed_ms(lambda req=req: plain(req))[1] for req in requests[:cfg["batch"]]]
            _, ms_batch = timed_ms(lambda: plain(batch))
            _, ms_batch = timed_ms(lambda: plain(batch))  # the second run: every bucket captured
            rps_one, rps_batch = 1000 / statistics.mean(singles), 1000 * len(batch.pb.lengths) / ms_batch
            emit("batched", {**label, "batch": len(batch.pb.lengths), "one_at_a_time_rps": rps_one,
                             "batched_rps": rps_batch, "ratio": rps_batch / rps_one, "batch_ms": ms_batch})

    # relaxed speculation vs the target's own sampling beam search
    def stage_relaxed() -> None:
        rows, ran = [], set()
        for i, req in enumerate(requests):
            if over():
                break
            ref, ms_p = timed_ms(lambda req=req, i=i: sampling(req, i))
            out, ms_s = timed_ms(lambda req=req, i=i: relaxed(req, i))
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
                out = plain(inputs.request([u.history for u in group]))
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
                                                                engines(target, drafter) if m.graph_runner],
                    "plain_steps": steps.summary() if steps is not None else None})
