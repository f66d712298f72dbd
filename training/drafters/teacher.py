"""Teacher data for drafter alignment: the target's top-K beams and code log-probs per training prefix.

    recsvc train teacher --bundle B --k 20 [--max-prefixes N] [--batch-size 32] [--lambda-mix 0.0]

Prefixes: every training window's predicted item, i.e. (user, t) for t >= 1 over the user's TRAIN items, with
exactly the inference prompt ``prompt_ids(train[user][:t])`` (the last <= max_history items). For each, the
TARGET's plain trie-constrained beam search (the engine's, K beams, its tie-break) gives the top-K ids, and
the same KV tree (every beam's ancestors are cached by the search) gives the target's distribution at every
(beam, position) without another prompt pass; one extra small forward adds the ground-truth item's path.

Stored log-probs: the engine's convention, log_softmax over the FULL vocabulary in float32, sliced to the
256 code tokens of the position's level, not renormalised (``exp`` sums to <= 1), saved as fp16 (-inf where
the probability underflows). Losses renormalise where they need to (``training/drafters/losses.py``).

Layout (safetensors only)::

    BUNDLE/teacher/meta.json               config, fingerprints of the target / ids (/ drafter), "complete"
    BUNDLE/teacher/prefixes.safetensors    user [P], position [P], item [P] (the ground truth), source [P]
    BUNDLE/teacher/shard_00000.safetensors codes [n, K, 4] int16 (-1: no beam), logp [n, K, 4, 256] fp16,
                                           gt_codes [n, 4] int16, gt_logp [n, 4, 256] fp16, index [n] int64

Shards hold ``shard_size`` consecutive prefixes (ordered by prompt length, which keeps batches unpadded);
a finished shard is written atomically and skipped on a rerun, so an interrupted build resumes.

Lambda-mixed sampling (AtSpeed-S, ``--lambda-mix``; the paper uses a mixture but gives no lambda): each
prefix independently (seeded) takes its K sequences from the CURRENT DRAFTER's own beam search
(BUNDLE/drafter) with probability lambda, else from the target's; the stored log-probs are always the
target's along those sequences. ``source`` records which (0 target, 1 drafter).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from recsvc.errors import UserError

VERSION = 1
META, PREFIXES = "meta.json", "prefixes.safetensors"
LOGP_CONVENTION = "full-vocabulary log_softmax (float32) sliced to the level's 256 code tokens; fp16; not renormalised"


def teacher_dir(bundle) -> Path:
    return Path(bundle.root) / "teacher"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_fingerprint(model_dir: Path) -> str:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"no model in {model_dir}")
    return hashlib.sha256("".join(file_sha256(f) for f in files).encode()).hexdigest()[:16]


def training_prefixes(train: dict[int, list[int]]) -> list[tuple[int, int]]:
    """(user, t) for every predicted training item (t >= 1), users ascending."""
    return [(u, t) for u in sorted(train) for t in range(1, len(train[u]))]


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.safetensors"


# ------------------------------------------------------------------------------------------------ reading


class TeacherStore:
    """Random access to finished teacher data; rows are read lazily from the shards (safetensors slices)."""

    def __init__(self, root: str | Path) -> None:
        from safetensors.torch import load_file

        self.root = Path(root)
        if not (self.root / META).is_file():
            raise UserError(f"no teacher data in {self.root}: run `recsvc train teacher --bundle ...` first")
        self.meta: dict[str, Any] = json.loads((self.root / META).read_text())
        if not self.meta.get("complete"):
            raise UserError(f"teacher data in {self.root} is incomplete: rerun `recsvc train teacher` (it resumes)")
        pre = load_file(str(self.root / PREFIXES))
        self.user, self.position, self.item, self.source = pre["user"], pre["position"], pre["item"], pre["source"]
        self.k: int = int(self.meta["k"])
        self.shard_size: int = int(self.meta["shard_size"])
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.user)

    def _shard(self, i: int):
        from safetensors import safe_open

        if i not in self._handles:
            self._handles[i] = safe_open(str(self.root / shard_name(i)), framework="pt")
        return self._handles[i]

    def rows(self, idx: Sequence[int]) -> dict[str, torch.Tensor]:
        """Global prefix indices -> codes [B, K, 4], logp [B, K, 4, C], gt_codes [B, 4], gt_logp [B, 4, C]."""
        names = ("codes", "logp", "gt_codes", "gt_logp")
        parts: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        for i in idx:
            f = self._shard(int(i) // self.shard_size)
            local = int(i) % self.shard_size
            for n in names:
                parts[n].append(f.get_slice(n)[local : local + 1])
        return {n: torch.cat(v) for n, v in parts.items()}

    def check_target(self, bundle) -> None:
        """UserError when the bundle's target or ids changed since the teacher data was built."""
        if self.meta["target"] != model_fingerprint(bundle.target_dir):
            raise UserError(f"teacher data in {self.root} was built from another target: rebuild it with "
                            "`recsvc train teacher --force` (the drafter must follow the current target)")
        if self.meta["ids"] != file_sha256(bundle.semantic_ids_path)[:16]:
            raise UserError(f"teacher data in {self.root} was built from other semantic ids: rebuild with --force")


# ------------------------------------------------------------------------------------------------ building


@torch.inference_mode()
def _search(model, trie, code_offset: int, prompts, k: int, select, prior: torch.Tensor | None = None):
    """The engine's plain beam search with ``model`` (an EngineModel), keeping its TreeCache: (leaves [B, K],
    cache). ``prior`` [B, num_nodes]: the fused item prior, as served."""
    from recsvc.engine.caches.tree_cache import TreeCache
    from recsvc.engine.scoring.expand import expand_beams
    from recsvc.engine.search.beam_search import node_logprobs

    dev = trie.device  # the search runs where the trie is (the model's device)
    prompts = prompts.to(dev)
    prior = prior.to(dev) if prior is not None else None
    cache = TreeCache(model, trie, code_offset, prompts)
    b = len(prompts.lengths)
    nodes, scores = torch.zeros(b, 1, dtype=torch.long, device=dev), torch.zeros(b, 1, device=dev)
    for _ in range(trie.levels):
        cache.feed(nodes)
        logp = node_logprobs(model, cache, nodes)
        nodes, scores, _ = expand_beams(trie, nodes, scores, logp, k, None, select, prior)
    if nodes.shape[1] < k:  # a catalog with fewer than K ids at some depth
        nodes = torch.cat([nodes, torch.full((b, k - nodes.shape[1]), -1, dtype=torch.long, device=dev)], 1)
    return nodes, cache


@torch.inference_mode()
def _path_logprobs(target, cache, leaves: torch.Tensor, gt_leaves: torch.Tensor):
    """Target (EngineModel) log-probs at every position of the given leaves' paths: ([B, K, L, C], [B, L, C])."""
    from recsvc.engine.search.beam_search import node_logprobs

    trie = cache.trie
    every = torch.cat([leaves, gt_leaves[:, None]], 1)  # [B, K + 1]
    anc = trie.ancestors[every.clamp(min=0)]  # [B, K + 1, L]: depth 1..L nodes
    ctx = torch.cat([torch.zeros_like(anc[..., :1]), anc[..., :-1]], -1)  # contexts of positions 0..L-1
    ctx = torch.where((every >= 0)[..., None], ctx, -1)
    cache.feed(ctx[..., -1])  # whatever is not cached yet (the truth's path; drafter-made beams), one forward
    b, s, length = ctx.shape
    logp = node_logprobs(target, cache, ctx.reshape(b, -1)).view(b, s, length, -1)
    return logp[:, :-1], logp[:, -1]


def _config(k: int, max_prefixes: int | None, lambda_mix: float, shard_size: int, seed: int, dtype: str,
            max_history: int, attention: str) -> dict[str, Any]:
    return {"k": k, "max_prefixes": max_prefixes, "lambda_mix": lambda_mix, "shard_size": shard_size,
            "seed": seed, "dtype": dtype, "max_history": max_history, "attention": attention}


def build_teacher(bundle_dir: str | Path, k: int = 20, max_prefixes: int | None = None, batch_size: int = 32,
                  lambda_mix: float = 0.0, shard_size: int = 1024, seed: int = 0, dtype: str = "auto",
                  data_dir: str | Path | None = None, force: bool = False, progress: bool = True,
                  attention: str = "fp32") -> dict[str, Any]:
    """Build (or resume) BUNDLE/teacher; returns meta.json's content. ``dtype`` / ``attention``: the target as
    the service runs it (bf16, the engine's "fp32" attention mode) unless told otherwise."""
    import shutil

    from safetensors.torch import save_file

    from recsvc.bundle.directory import Bundle
    from recsvc.data.split import load_split_dir
    from recsvc.engine.caches.prompts import PromptBatch
    from recsvc.engine.kernels.engine_model import EngineModel
    from recsvc.engine.search.beam_search import BeamSearch
    from recsvc_base.progress import progress_bar
    from tokenizer_rqvae.trie import CatalogTrie

    if k < 1 or batch_size < 1 or shard_size < 1:
        raise UserError("--k, --batch-size and the shard size must be >= 1")
    if not 0.0 <= lambda_mix <= 1.0:
        raise UserError(f"--lambda-mix must lie in [0, 1], got {lambda_mix}")
    if max_prefixes is not None and max_prefixes < 1:
        raise UserError("--max-prefixes must be >= 1")
    bundle = Bundle.open(bundle_dir)
    data_path = bundle.resolve_data_dir(data_dir)
    data = load_split_dir(data_path)
    ids = bundle.load_ids()
    builder = bundle.prompt_builder(ids=ids)
    out = teacher_dir(bundle)
    cfg = _config(k, max_prefixes, lambda_mix, shard_size, seed, dtype, builder.max_history, attention)
    fingerprints = {"target": model_fingerprint(bundle.target_dir),
                    "ids": file_sha256(bundle.semantic_ids_path)[:16],
                    "drafter": model_fingerprint(bundle.drafter_dir) if lambda_mix > 0 else None}
    if lambda_mix > 0 and not (bundle.drafter_dir / "config.json").is_file():
        raise UserError(f"--lambda-mix needs the current drafter in {bundle.drafter_dir}")
    if force:
        shutil.rmtree(out, ignore_errors=True)
    elif (out / META).is_file():
        old = json.loads((out / META).read_text())
        if {key: old.get(key) for key in (*cfg, *fingerprints)} != {**cfg, **fingerprints}:
            raise UserError(f"{out} holds teacher data of another configuration or target: pass --force to rebuild")
    out.mkdir(parents=True, exist_ok=True)

    prefixes = training_prefixes(data.train)
    if max_prefixes is not None and len(prefixes) > max_prefixes:
        prefixes = random.Random(seed).sample(prefixes, max_prefixes)
    prefixes.sort(key=lambda p: (min(p[1], builder.max_history), p[0], p[1]))  # similar prompt lengths together
    if not prefixes:
        raise UserError("no training prefixes (every user has fewer than 2 train items?)")
    rng = random.Random(seed + 1)
    source = [int(rng.random() < lambda_mix) for _ in prefixes]
    save_file({"user": torch.tensor([u for u, _ in prefixes]), "position": torch.tensor([t for _, t in prefixes]),
               "item": torch.tensor([data.train[u][t] for u, t in prefixes]),
               "source": torch.tensor(source, dtype=torch.int8)}, str(out / PREFIXES))
    n_shards = (len(prefixes) + shard_size - 1) // shard_size
    meta = {"version": VERSION, **cfg, **fingerprints, "num_prefixes": len(prefixes), "num_shards": n_shards,
            "levels": ids.levels, "codebook": 256, "logp": LOGP_CONVENTION, "complete": False}
    (out / META).write_text(json.dumps(meta, indent=1))

    trie = CatalogTrie(ids)
    off = builder.code_offset
    target = EngineModel.build(bundle.load_target(dtype=dtype), attention)  # the served engine's attention mode
    select = BeamSearch(target, trie, off).select  # and its tie-break
    drafter = EngineModel.build(bundle.load_drafter(dtype=dtype), attention) if lambda_mix > 0 else None
    todo = [s for s in range(n_shards) if not (out / shard_name(s)).is_file()]
    start = time.monotonic()
    done = len(prefixes) - sum(min(shard_size, len(prefixes) - s * shard_size) for s in todo)
    bar = progress_bar(total=len(prefixes), initial=done, desc=f"teacher K={k}", unit="prefix", enabled=progress,
                       dynamic_ncols=True, mininterval=1.0)
    for s in todo:
        lo, hi = s * shard_size, min((s + 1) * shard_size, len(prefixes))
        codes, logp, gt_codes, gt_logp = [], [], [], []
        for b0 in range(lo, hi, batch_size):
            rows = range(b0, min(b0 + batch_size, hi))
            for src in (0, 1):
                sel = [i for i in rows if source[i] == src]
                if not sel:
                    continue
                hist = [data.train[prefixes[i][0]][: prefixes[i][1]] for i in sel]
                truth = [data.train[prefixes[i][0]][prefixes[i][1]] for i in sel]
                pb = PromptBatch.from_lists([builder.prompt_ids(h) for h in hist])
                gt_leaves = trie.item_path[torch.tensor([ids.index_of(t) for t in truth]), -1]  # [b]
                if src == 0:
                    leaves, cache = _search(target, trie, off, pb, k, select)
                else:  # lambda-mix: the drafter's own beams, scored by the target (a fresh target cache)
                    from recsvc.engine.caches.tree_cache import TreeCache

                    leaves, _ = _search(drafter, trie, off, pb, k, None)
                    cache = TreeCache(target, trie, off, pb)
                lp, lp_gt = _path_logprobs(target, cache, leaves, gt_leaves)
                order = torch.tensor(sel)
                codes.append((order, trie.codes_of_nodes(leaves).to(torch.int16)))
                logp.append(lp.to(torch.float16))
                gt_codes.append(trie.codes_of_nodes(gt_leaves).to(torch.int16))
                gt_logp.append(lp_gt.to(torch.float16))
            bar.update(len(rows))
        index = torch.cat([o for o, _ in codes])
        perm = torch.argsort(index)  # back to prefix order (target rows and drafter rows were split)
        tensors = {"index": index[perm], "codes": torch.cat([c for _, c in codes])[perm],
                   "logp": torch.cat(logp)[perm], "gt_codes": torch.cat(gt_codes)[perm],
                   "gt_logp": torch.cat(gt_logp)[perm]}
        tmp = out / (shard_name(s) + ".tmp")
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp))
        os.replace(tmp, out / shard_name(s))
    bar.close()
    meta.update(complete=True, seconds=round(time.monotonic() - start, 1))
    (out / META).write_text(json.dumps(meta, indent=1))
    bundle.mark_done("teacher", k=k, prefixes=len(prefixes), lambda_mix=lambda_mix, target=fingerprints["target"])
    return meta


# ------------------------------------------------------------------------------------------------ batches


def collate_tree(rows: dict[str, torch.Tensor], prompts: Sequence[Sequence[int]], trie, code_offset: int,
                 pad_id: int, k: int) -> dict[str, torch.Tensor]:
    """Teacher rows + prompts -> one drafter forward's inputs (see ``drafter_losses.code_logprobs_tree``).

    Row layout: [the prompt's last token, the unique tree nodes of the K beams and the truth (parents
    first), the rest of the prompt], each token attending its prompt prefix (causal) or the whole prompt, its
    ancestors and itself; position ids as in inference (prompt length + depth - 1 for tree nodes)."""
    codes = rows["codes"][:, :k].long()  # [B, K, L]
    gt = rows["gt_codes"].long()  # [B, L]
    b, kk, length = codes.shape
    valid = codes[..., 0] >= 0  # [B, K]
    seq = torch.cat([codes, gt[:, None]], 1)  # [B, S = K + 1, L]
    seq_ok = torch.cat([valid, torch.ones(b, 1, dtype=torch.bool)], 1)
    node = torch.zeros(b, kk + 1, dtype=torch.long)
    ctx = [node]
    for t in range(length - 1):  # contexts (trie nodes) of positions 1..L-1
        node = trie.children[node.clamp(min=0), seq[..., t].clamp(min=0)]
        node = torch.where(seq_ok & (node >= 0), node, -1)
        ctx.append(node)
    ctx_t = torch.stack(ctx, -1)  # [B, S, L]
    if ((ctx_t < 0) & seq_ok[..., None]).any():
        raise UserError("teacher codes are not in the catalog trie: rebuild the teacher data (--force)")
    allowed = (trie.children[ctx_t.clamp(min=0)] >= 0) & (ctx_t >= 0)[..., None]  # [B, S, L, C]

    nodes = [torch.unique(ctx_t[r, :, 1:][ctx_t[r, :, 1:] > 0]) for r in range(b)]  # sorted: parents first
    n_max = max(len(n) for n in nodes)
    t_max = max(len(p) for p in prompts)
    width = 1 + n_max + t_max - 1
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    pos = torch.zeros(b, width, dtype=torch.long)
    att = torch.eye(width, dtype=torch.bool).repeat(b, 1, 1)  # padding attends itself only
    slot = torch.zeros(b, kk + 1, length, dtype=torch.long)
    slot_level = torch.zeros(b, 1 + n_max, dtype=torch.long)
    n_tokens = 0
    for r in range(b):
        p = torch.tensor(prompts[r], dtype=torch.long)
        t_len, nd = len(p), nodes[r]
        sp = torch.cat([torch.arange(1 + n_max, n_max + t_len), torch.tensor([0])])  # slot of prompt token i
        ids[r, sp], pos[r, sp] = p, torch.arange(t_len)
        att[r][sp[:, None], sp[None, :]] = torch.ones(t_len, t_len, dtype=torch.bool).tril()
        ns = 1 + torch.arange(len(nd))
        depth = trie.depth[nd]
        ids[r, ns] = code_offset + (depth - 1) * trie.codebook_size + trie.node_code[nd]
        pos[r, ns] = t_len + depth - 1
        slot_of = torch.full((trie.num_nodes,), -1, dtype=torch.long)
        slot_of[nd] = ns
        att[r][ns[:, None], sp[None, :]] = True
        anc = trie.ancestors[nd]  # [n, L] the node's path, itself included
        ok = anc >= 0
        att[r][ns[:, None].expand_as(anc)[ok], slot_of[anc[ok]]] = True
        slot_level[r, ns] = depth
        slot[r] = torch.where(ctx_t[r] > 0, slot_of[ctx_t[r].clamp(min=0)], 0)
        n_tokens += t_len + len(nd)
    return {"input_ids": ids, "position_ids": pos, "attention_mask": att[:, None], "slot": slot,
            "slot_level": slot_level, "codes": codes, "gt": gt, "valid": valid, "allowed": allowed[:, :-1],
            "lp": rows["logp"][:, :k], "lp_gt": rows["gt_logp"], "num_tokens": torch.tensor(n_tokens)}
