"""RQ-VAE (LC-Rec style): MLP encoder -> residual quantizer (levels x codebook_size) -> mirrored MLP decoder.

Loss = MSE(x_hat, x) + sum_l [ ||sg(r_l) - e_l||^2 + beta * ||r_l - sg(e_l)||^2 ], straight-through estimator;
r_0 = z = enc(x), r_{l+1} = r_l - sg(e_l) where e_l is the code of level l nearest to r_l. With CF embeddings
(``cf_weight`` > 0), a LETTER-style contrastive term aligns each item's codeword sum with its collaborative
embedding (``tokenizer_rqvae.collaborative``). Worked example
(2 levels, 1-d latent, codebooks [[0, 4], [-1, 1]]): z = 3.2 -> level 0 picks code 1 (4), r_1 = -0.8 ->
level 1 picks code 0 (-1): codes (1, 0), z_q = 3.0, final residual 0.2.

Codebooks are initialised by faiss k-means on the residuals of a large sample (up to ``kmeans_sample`` items,
the whole Beauty catalog) level by level. Anti-collapse: per-level usage is counted each epoch and codes no
training item picked during the epoch are re-seeded from random current residuals of that level (their AdamW
moments reset). Optional Sinkhorn (uniform assignment, log domain) on the last level while training.

Why our own quantizer, not vector-quantize-pytorch's ``ResidualVQ`` (measured, Beauty MiniLM embeddings, same
MLPs / bf16 / 1 thread / 300 epochs / lr 2e-3 on the shared 2-core box; ResidualVQ 1.32.0 in a throw-away
``--target`` dir): ours 80.8 s, recon_mse 0.000861, 73 raw collisions, 256/256 codes per level;
``ResidualVQ`` (EMA, kmeans_init, threshold_ema_dead_code=2) 131.0 s, 0.000867, 99; ``ResidualVQ``
(learnable_codebook, no EMA = the LC-Rec loss) 132.5 s, 0.000836, 107. Quality is a wash; ours was ~1.6x
faster per epoch (not profiled; the box was shared, so single timings carry maybe +-30 %), and ResidualVQ would
add four dependencies (einops, einx + frozendict, loguru, torch-einops-utils). Its k-means initialises on the first
batch only (faiss on the whole catalog here), and per-level distances for collision handling, dead-code
re-seeding with AdamW-moment reset and safetensors checkpoints with exact resume would be bolted on from
outside anyway. So the quantizer is ~80 lines here.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from recsvc_base.errors import UserError
from tokenizer_rqvae.collaborative import cf_alignment_loss
from tokenizer_rqvae.embed import torch_threads
from tokenizer_rqvae.kmeans import kmeans

MODEL_FILE = "rqvae.safetensors"
CONFIG_FILE = "rqvae_config.json"
CKPT_MODEL = "checkpoint_model.safetensors"
CKPT_STATE = "checkpoint_state.safetensors"
CKPT_JSON = "checkpoint.json"


@dataclass(frozen=True)
class RQVAEConfig:
    """Architecture + training settings; stored next to the weights as ``rqvae_config.json``."""

    in_dim: int = 384
    hidden_dims: tuple[int, ...] = (512, 256, 128, 64)
    latent_dim: int = 32
    levels: int = 4
    codebook_size: int = 256
    dropout: float = 0.0
    beta: float = 0.25
    # x is multiplied by this before the encoder (the decoder's target is scaled x too). None = automatic:
    # 1 / RMS of the training inputs, so elements are O(1) (normalized 384-d MiniLM vectors: ~19.6). Without
    # it the reconstruction term is ~1e-3 and the commitment term collapses the latent (measured: level-1
    # usage 126/256, 10,517 collisions before resolution, see BENCHMARKS.md).
    input_scale: float | None = None
    # MLP matmuls in bfloat16 (autocast; the quantizer, losses and codebooks stay float32). None = automatic:
    # "bf16" on CUDA and on CPUs with native bf16 (AVX-512 BF16 / AMX), else "fp32"; resolved at training
    # time and stored. Measured on the 2-core Zen 4 box: 23 ms vs 54 ms per 1024-item step (1 thread).
    precision: str | None = None
    lr: float = 2e-3  # Beauty, 200 epochs: recon_mse 0.000907 at 2e-3 vs 0.000949 at 1e-3
    weight_decay: float = 1e-4  # encoder / decoder only; codebooks are not decayed
    batch_size: int = 1024
    # Beauty on the shared 2-core box: 0.27-0.42 s per epoch (bf16, 1 thread) -> 300 epochs ~1.5-2 min, so a
    # cached rebuild stays well under 5 minutes even when other jobs share the cores (see BENCHMARKS.md).
    epochs: int = 300
    seed: int = 0
    kmeans_iters: int = 20
    kmeans_sample: int = 65536
    reseed_dead: bool = True
    sinkhorn_last: bool = False
    sinkhorn_epsilon: float = 0.003
    sinkhorn_iters: int = 50
    checkpoint_every: int = 50
    # CPU threads while training. 1 by default: the MLP is small, and on a shared 2-core box two OpenMP threads
    # that get descheduled wait for each other (measured: 1.38 s vs 0.054 s per step with another 2-thread
    # job running). A fixed count also keeps results bit-identical from run to run.
    train_threads: int = 1
    # LETTER-style collaborative regularisation (tokenizer_rqvae.collaborative): weight of the contrastive term
    # between an item's codeword sum and its CF embedding (0: text only), and its temperature. Used only when
    # the build is given CF embeddings.
    cf_weight: float = 0.0
    cf_temperature: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_dims", tuple(int(h) for h in self.hidden_dims))
        checks = [
            (self.in_dim > 0, "in_dim must be > 0"),
            (self.latent_dim > 0, "latent_dim must be > 0"),
            (all(h > 0 for h in self.hidden_dims), "hidden_dims must be positive"),
            (self.levels >= 1, "levels must be >= 1"),
            (self.codebook_size >= 2, "codebook_size must be >= 2"),
            (0.0 <= self.dropout < 1.0, "dropout must lie in [0, 1)"),
            (self.epochs >= 0, "epochs must be >= 0"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.lr > 0, "lr must be > 0"),
            (self.input_scale is None or self.input_scale > 0, "input_scale must be > 0 (or None = auto)"),
            (self.sinkhorn_epsilon > 0 and self.sinkhorn_iters >= 1, "sinkhorn_epsilon / iters must be > 0"),
            (self.checkpoint_every >= 1, "checkpoint_every must be >= 1"),
            (self.precision in (None, "bf16", "fp32"), "precision must be 'bf16', 'fp32' or None (auto)"),
            (self.train_threads >= 1, "train_threads must be >= 1"),
            (self.cf_weight >= 0 and math.isfinite(self.cf_weight), "cf_weight must be finite and >= 0"),
            (self.cf_temperature > 0, "cf_temperature must be > 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise UserError(f"RQVAEConfig: {msg}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["hidden_dims"] = list(self.hidden_dims)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RQVAEConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise UserError(f"RQVAEConfig: unknown keys {sorted(unknown)}")
        return cls(**d)

    def architecture(self) -> dict[str, Any]:
        """The fields that decide the weights' shapes / meaning (a checkpoint must match these to resume)."""
        d = self.to_json()
        for k in ("epochs", "checkpoint_every", "train_threads"):
            d.pop(k)
        return d


# ------------------------------------------------------------------------------------------------ helpers
def auto_input_scale(x: np.ndarray) -> float:
    """1 / RMS of x [n, d] (rounded to 4 significant digits so the config json stays readable)."""
    rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))
    return float(f"{1.0 / max(rms, 1e-12):.4g}")


def auto_precision(device: str) -> str:
    """"bf16" where bfloat16 matmuls are native (CUDA, or a CPU oneDNN reports bf16 support), else "fp32"."""
    if device.startswith("cuda"):
        return "bf16"
    try:
        return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    except (AttributeError, RuntimeError):  # pragma: no cover - older / unusual builds
        return "fp32"


def mlp(dims: list[int], dropout: float) -> nn.Sequential:
    """``mlp([384, 512, 32])`` = Linear(384, 512), ReLU, [Dropout], Linear(512, 32) (no activation at the end)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def sq_dists(r: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """r [B, D], e [K, D] -> squared euclidean distances [B, K]."""
    return (r * r).sum(-1, keepdim=True) - 2.0 * (r @ e.T) + (e * e).sum(-1)[None, :]


def sinkhorn(dists: torch.Tensor, epsilon: float, iters: int) -> torch.Tensor:
    """Uniform-marginal assignment (LC-Rec): dists [B, K] -> plan Q [B, K] (rows sum to 1/B, cols to 1/K).

    Distances are centred and scaled to [-1, 1] first (as LC-Rec does) so ``epsilon`` is scale-free; computed
    in log space. ``Q.argmax(1)`` spreads a batch over the codebook as evenly as the distances allow.
    """
    d = dists.double()
    d = d - d.mean()
    d = d / d.abs().max().clamp_min(1e-12)
    b, k = d.shape
    log_q = -d / epsilon  # [B, K]
    log_r, log_c = -math.log(b), -math.log(k)
    for _ in range(iters):
        log_q = log_q - (torch.logsumexp(log_q, dim=0, keepdim=True) - log_c)  # columns -> 1/K
        log_q = log_q - (torch.logsumexp(log_q, dim=1, keepdim=True) - log_r)  # rows -> 1/B
    return log_q.exp().float()


@dataclass
class Quantized:
    z_q: torch.Tensor  # [B, D] straight-through quantized latent
    codewords: torch.Tensor  # [B, D] the codeword sum (value of z_q) with gradient to the codebooks and z
    codes: torch.Tensor  # [B, L] int64
    residuals: torch.Tensor  # [B, L, D] residual entering each level (detached)
    quant_loss: torch.Tensor  # scalar


@dataclass
class Encoding:
    """Numpy results of :meth:`RQVAE.encode` for n items."""

    codes: np.ndarray  # [n, L] int64
    dists: np.ndarray  # [n, L, K] float32: squared distance of each level's residual to that codebook
    residuals: np.ndarray  # [n, L, D] float32: residual entering each level (residuals[:, 0] = latent)
    recon_mse: float  # mean over items and dims of (x_hat - x)^2 (in input units)


# ------------------------------------------------------------------------------------------------ model
class RQVAE(nn.Module):
    def __init__(self, config: RQVAEConfig) -> None:
        super().__init__()
        self.config = config
        dims = [config.in_dim, *config.hidden_dims, config.latent_dim]
        self.encoder = mlp(dims, config.dropout)
        self.decoder = mlp(dims[::-1], config.dropout)
        self.codebooks = nn.Parameter(torch.randn(config.levels, config.codebook_size, config.latent_dim) * 0.01)

    def quantize(self, z: torch.Tensor, sinkhorn_last: bool = False) -> Quantized:
        """z [B, D] -> straight-through z_q [B, D], codes [B, L], residuals [B, L, D], quantization loss."""
        cfg = self.config
        r = z
        z_q = torch.zeros_like(z)
        codes, residuals = [], []
        loss = z.new_zeros(())
        for lv in range(cfg.levels):
            e = self.codebooks[lv]  # [K, D]
            d = sq_dists(r.detach(), e.detach())  # [B, K]
            if sinkhorn_last and lv == cfg.levels - 1 and r.shape[0] > 1:
                idx = sinkhorn(d, cfg.sinkhorn_epsilon, cfg.sinkhorn_iters).argmax(1)
            else:
                idx = d.argmin(1)  # [B]
            q = e[idx]  # [B, D]
            loss = loss + ((r.detach() - q) ** 2).mean() + cfg.beta * ((r - q.detach()) ** 2).mean()
            residuals.append(r.detach())
            codes.append(idx)
            z_q = z_q + q
            r = r - q.detach()
        z_st = z + (z_q - z).detach()  # straight-through: forward z_q, gradient to z
        both = z_st + (z_q - z_q.detach())  # the same value; gradient to z and to the chosen codewords
        return Quantized(z_st, both, torch.stack(codes, 1), torch.stack(residuals, 1), loss)

    def _autocast(self, x: torch.Tensor) -> torch.autocast:
        return torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.config.precision == "bf16")

    def encode_latent(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, in] (scaled) -> z [B, D] float32."""
        with self._autocast(x):
            return self.encoder(x).float()

    def decode_latent(self, z_q: torch.Tensor) -> torch.Tensor:
        """z_q [B, D] -> x_hat [B, in] float32 (scaled units)."""
        with self._autocast(z_q):
            return self.decoder(z_q).float()

    def forward(self, x: torch.Tensor, sinkhorn_last: bool = False) -> tuple[torch.Tensor, Quantized]:
        """x [B, in] (already scaled) -> x_hat [B, in], quantization results."""
        quant = self.quantize(self.encode_latent(x), sinkhorn_last)
        return self.decode_latent(quant.z_q), quant

    @torch.no_grad()
    def residuals_of(self, x: torch.Tensor, levels: int) -> list[torch.Tensor]:
        """x [B, in] -> the residuals entering levels 0..levels-1 ([B, D] each), by argmin codes."""
        r = self.encode_latent(x)
        out = []
        for lv in range(levels):
            out.append(r)
            e = self.codebooks[lv]
            r = r - e[sq_dists(r, e).argmin(1)]
        return out

    @torch.no_grad()
    def init_codebooks(self, x: torch.Tensor, seed: int) -> None:
        """Level-wise faiss k-means on the residuals of the sample x [S, in] (scaled inputs)."""
        cfg = self.config
        r = self.encode_latent(x)  # [S, D]
        for lv in range(cfg.levels):
            cents = kmeans(r.cpu().numpy(), cfg.codebook_size, niter=cfg.kmeans_iters, seed=seed + lv,
                           threads=cfg.train_threads)
            e = torch.from_numpy(cents).to(self.codebooks)  # [K, D]
            self.codebooks[lv].copy_(e)
            r = r - e[sq_dists(r, e).argmin(1)]

    @torch.no_grad()
    def encode(self, x: np.ndarray, batch_size: int = 4096, device: str = "cpu") -> Encoding:
        """x [n, in] raw embeddings -> codes [n, L] by nearest code per level, plus distances / residuals."""
        was_training = self.training
        self.eval()
        codes, dists, residuals = [], [], []
        se, count = 0.0, 0
        scale = self.config.input_scale or 1.0
        for start in range(0, x.shape[0], batch_size):
            xb = torch.from_numpy(np.ascontiguousarray(x[start : start + batch_size], dtype=np.float32))
            xb = xb.to(device) * scale  # [B, in]
            r = self.encode_latent(xb)
            z_q = torch.zeros_like(r)
            c_b, d_b, r_b = [], [], []
            for lv in range(self.config.levels):
                e = self.codebooks[lv]
                d = sq_dists(r, e).clamp_min(0)  # [B, K]
                idx = d.argmin(1)
                c_b.append(idx)
                d_b.append(d)
                r_b.append(r)
                z_q = z_q + e[idx]
                r = r - e[idx]
            x_hat = self.decode_latent(z_q) / scale
            se += float(((x_hat - xb / scale) ** 2).sum())
            count += xb.numel()
            codes.append(torch.stack(c_b, 1).cpu())
            dists.append(torch.stack(d_b, 1).cpu())
            residuals.append(torch.stack(r_b, 1).cpu())
        self.train(was_training)
        cfg = self.config
        if not codes:
            return Encoding(np.zeros((0, cfg.levels), np.int64), np.zeros((0, cfg.levels, cfg.codebook_size),
                            np.float32), np.zeros((0, cfg.levels, cfg.latent_dim), np.float32), 0.0)
        return Encoding(
            torch.cat(codes).numpy().astype(np.int64),
            torch.cat(dists).numpy().astype(np.float32),
            torch.cat(residuals).numpy().astype(np.float32),
            se / max(count, 1),
        )


# ------------------------------------------------------------------------------------------------ save / load
def save_rqvae(model: RQVAE, out_dir: str | Path) -> None:
    """-> out_dir/rqvae.safetensors + out_dir/rqvae_config.json."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / MODEL_FILE))
    (out / CONFIG_FILE).write_text(json.dumps(model.config.to_json(), indent=2))


def load_rqvae(model_dir: str | Path, device: str = "cpu") -> RQVAE:
    """Inverse of :func:`save_rqvae` (safetensors only)."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    for name in (MODEL_FILE, CONFIG_FILE):
        if not (d / name).is_file():
            raise UserError(f"{d / name} not found (run `recsvc tokenizer build` first)")
    try:
        config = RQVAEConfig.from_json(json.loads((d / CONFIG_FILE).read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise UserError(f"{d / CONFIG_FILE}: bad config: {exc}") from exc
    model = RQVAE(config)
    model.load_state_dict(load_file(str(d / MODEL_FILE), device="cpu"))
    return model.to(device).eval()


# ------------------------------------------------------------------------------------------------ training
@dataclass
class TrainResult:
    model: RQVAE
    history: list[dict[str, Any]]  # one row per epoch: loss, recon, quant, usage per level, reseeded
    epochs_run: int  # epochs trained in this call (0 when a finished checkpoint was resumed)
    seconds: float
    final_reseeded: list[int]  # per level: codes no item picks with the final weights, re-seeded at the end


def _data_digest(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x, dtype=np.float32).tobytes()).hexdigest()


def _optimizer(model: RQVAE, cfg: RQVAEConfig) -> torch.optim.AdamW:
    nets = [p for n, p in model.named_parameters() if n != "codebooks"]
    return torch.optim.AdamW(
        [{"params": nets, "weight_decay": cfg.weight_decay}, {"params": [model.codebooks], "weight_decay": 0.0}],
        lr=cfg.lr,
    )


def _save_checkpoint(ckpt_dir: Path, model: RQVAE, opt: torch.optim.Optimizer, gen: torch.Generator,
                     epoch: int, history: list[dict[str, Any]], digest: str) -> None:
    """Model + optimizer tensors + RNG states as safetensors, the rest as json (written last = commit)."""
    from safetensors.torch import save_file

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(ckpt_dir / CKPT_MODEL))
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for pid, st in sd["state"].items():
        for name, val in st.items():
            t = val if torch.is_tensor(val) else torch.tensor(val)
            tensors[f"opt.{pid}.{name}"] = t.detach().cpu().contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.shuffle"] = gen.get_state()
    save_file(tensors, str(ckpt_dir / CKPT_STATE))
    meta = {"epoch": epoch, "config": model.config.to_json(), "param_groups": sd["param_groups"],
            "history": history, "data_sha256": digest}
    tmp = ckpt_dir / (CKPT_JSON + ".tmp")
    tmp.write_text(json.dumps(meta))
    tmp.replace(ckpt_dir / CKPT_JSON)


def _load_checkpoint(ckpt_dir: Path, model: RQVAE, opt: torch.optim.Optimizer, gen: torch.Generator,
                     digest: str) -> tuple[int, list[dict[str, Any]]]:
    """Restore a checkpoint into model / opt / gen; -> (epochs done, history). (0, []) when none exists."""
    from safetensors.torch import load_file

    if not (ckpt_dir / CKPT_JSON).is_file():
        return 0, []
    meta = json.loads((ckpt_dir / CKPT_JSON).read_text())
    saved = RQVAEConfig.from_json(meta["config"])
    if saved.architecture() != model.config.architecture():
        diff = {k: (v, model.config.architecture()[k]) for k, v in saved.architecture().items()
                if model.config.architecture()[k] != v}
        raise UserError(f"--resume: checkpoint in {ckpt_dir} has other settings {diff} (checkpoint, now); "
                        "drop --resume or use another --out")
    if meta.get("data_sha256") != digest:
        raise UserError(f"--resume: checkpoint in {ckpt_dir} was trained on other embeddings; "
                        "drop --resume or use another --out")
    model.load_state_dict(load_file(str(ckpt_dir / CKPT_MODEL)))
    tensors = load_file(str(ckpt_dir / CKPT_STATE))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, val in tensors.items():
        if key.startswith("opt."):
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = val
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    gen.set_state(tensors["rng.shuffle"])
    return int(meta["epoch"]), list(meta["history"])


@torch.no_grad()
def _reseed_dead(model: RQVAE, opt: torch.optim.Optimizer, x: torch.Tensor, usage: torch.Tensor,
                 gen: torch.Generator) -> list[int]:
    """Codes with usage 0 (usage [L, K]) <- random current residuals of their level; -> count per level."""
    cfg = model.config
    dead = usage == 0  # [L, K]
    if not dead.any():
        return [0] * cfg.levels
    pick = torch.randperm(x.shape[0], generator=gen)[: max(cfg.codebook_size, 1024)]
    residuals = model.residuals_of(x[pick], cfg.levels)  # L x [S, D]
    state = opt.state.get(model.codebooks, {})
    counts = []
    for lv in range(cfg.levels):
        idx = dead[lv].nonzero().flatten()  # [m]
        counts.append(int(idx.numel()))
        if idx.numel() == 0:
            continue
        pool = residuals[lv]  # [S, D]
        if pool.shape[0] >= idx.numel():  # distinct residuals when there are enough
            rows = torch.randperm(pool.shape[0], generator=gen)[: idx.numel()]
        else:
            rows = torch.randint(0, pool.shape[0], (idx.numel(),), generator=gen)
        noise = torch.randn(idx.numel(), cfg.latent_dim, generator=gen) * 1e-4
        model.codebooks[lv, idx] = pool[rows] + noise.to(pool)
        for name in ("exp_avg", "exp_avg_sq"):
            if name in state:
                state[name][lv, idx] = 0.0
    return counts


def train_rqvae(
    x: np.ndarray,
    config: RQVAEConfig,
    ckpt_dir: str | Path | None = None,
    resume: bool = False,
    device: str = "cpu",
    progress: bool = True,
    cf: tuple[np.ndarray, np.ndarray] | None = None,
) -> TrainResult:
    """Train on embeddings x [n, in_dim]; checkpoints every ``checkpoint_every`` epochs (and at the end) into
    ``ckpt_dir``; ``resume`` continues from its checkpoint (same settings and data, possibly more epochs).
    ``cf``: (CF embeddings [n, latent_dim] unit rows, has [n] bool) for the collaborative term
    (``tokenizer_rqvae.collaborative``; weighted by ``config.cf_weight``)."""
    cfg = config
    if x.ndim != 2 or x.shape[1] != cfg.in_dim:
        raise UserError(f"embeddings have shape {x.shape}, the RQ-VAE expects [n, {cfg.in_dim}]")
    if x.shape[0] == 0:
        raise UserError("no items to train on")
    if cf is not None and (cf[0].shape != (x.shape[0], cfg.latent_dim) or cf[1].shape != (x.shape[0],)):
        raise UserError(f"CF embeddings {cf[0].shape} / {cf[1].shape} do not match [{x.shape[0]}, "
                        f"{cfg.latent_dim}] / [{x.shape[0]}]")
    t0 = time.perf_counter()
    if cfg.input_scale is None:
        cfg = replace(cfg, input_scale=auto_input_scale(x))
    if cfg.precision is None:
        cfg = replace(cfg, precision=auto_precision(device))
    with torch_threads(cfg.train_threads):
        return _train(x, cfg, ckpt_dir, resume, device, progress, t0, cf)


def _train(x: np.ndarray, cfg: RQVAEConfig, ckpt_dir: str | Path | None, resume: bool, device: str,
           progress: bool, t0: float, cf: tuple[np.ndarray, np.ndarray] | None) -> TrainResult:
    from recsvc_base.progress import progress_bar

    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    digest = _data_digest(x) if cf is None else _data_digest(np.concatenate([x, cf[0], cf[1][:, None]], 1))
    cf_emb = cf_has = None  # [n, D] unit CF embeddings, [n] which items have one (the term is on)
    if cf is not None and cfg.cf_weight > 0:
        cf_emb, cf_has = torch.from_numpy(cf[0]).to(device), torch.from_numpy(cf[1]).to(device)
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device) * cfg.input_scale  # [n, in]
    model = RQVAE(cfg).to(device)
    opt = _optimizer(model, cfg)
    ckpt = Path(ckpt_dir) if ckpt_dir else None
    start, history = 0, []
    if resume and ckpt is not None:
        start, history = _load_checkpoint(ckpt, model, opt, gen, digest)
    if start == 0:
        sample = torch.randperm(xt.shape[0], generator=gen)[: cfg.kmeans_sample]
        model.init_codebooks(xt[sample], cfg.seed)
    n = xt.shape[0]
    bar = progress_bar(range(start, cfg.epochs), desc="rqvae", unit="epoch", enabled=progress,
               initial=start, total=cfg.epochs)
    for epoch in bar:
        model.train()
        usage = torch.zeros(cfg.levels, cfg.codebook_size, dtype=torch.long, device=device)  # [L, K]
        tot = {"loss": 0.0, "recon": 0.0, "quant": 0.0, **({"cf": 0.0} if cf_emb is not None else {})}
        perm = torch.randperm(n, generator=gen).to(device)
        for b in range(0, n, cfg.batch_size):
            rows = perm[b : b + cfg.batch_size]
            xb = xt[rows]  # [B, in]
            x_hat, q = model(xb, sinkhorn_last=cfg.sinkhorn_last)
            recon = ((x_hat - xb) ** 2).mean()
            loss = recon + q.quant_loss
            if cf_emb is not None and cf_has is not None:
                cf_loss = cf_alignment_loss(q.codewords, cf_emb[rows], cf_has[rows], cfg.cf_temperature)
                loss = loss + cfg.cf_weight * cf_loss
                tot["cf"] += float(cf_loss.detach()) * xb.shape[0] / n
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            w = xb.shape[0] / n
            tot["loss"] += float(loss.detach()) * w
            tot["recon"] += float(recon.detach()) * w
            tot["quant"] += float(q.quant_loss.detach()) * w
            for lv in range(cfg.levels):
                usage[lv] += torch.bincount(q.codes[:, lv], minlength=cfg.codebook_size)
        used = (usage > 0).sum(1).tolist()
        reseeded = _reseed_dead(model, opt, xt, usage, gen) if cfg.reseed_dead else [0] * cfg.levels
        history.append({"epoch": epoch + 1, **{k: round(v, 7) for k, v in tot.items()},
                        "used": used, "reseeded": reseeded})
        bar.set_postfix(loss=f"{tot['loss']:.4g}", recon=f"{tot['recon']:.3g}", used=used)
        done = epoch + 1
        if ckpt is not None and (done % cfg.checkpoint_every == 0 or done == cfg.epochs):
            _save_checkpoint(ckpt, model, opt, gen, done, history, digest)
    bar.close()
    model.eval()
    final = [0] * cfg.levels
    if cfg.reseed_dead and cfg.epochs > 0:
        # codes used during the last epoch can lose their items as the encoder moves; one last pass over the
        # final assignments (eval mode, all items) re-seeds them so the returned codebooks are all in use
        final = _reseed_dead(model, opt, xt, _usage(model, xt), gen)
    return TrainResult(model, history, max(0, cfg.epochs - start), time.perf_counter() - t0, final)


@torch.no_grad()
def _usage(model: RQVAE, x: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
    """How many items of x [n, in] (scaled) pick each code -> [L, K] (nearest-code assignment)."""
    cfg = model.config
    usage = torch.zeros(cfg.levels, cfg.codebook_size, dtype=torch.long, device=x.device)
    for b in range(0, x.shape[0], batch_size):
        r = model.encode_latent(x[b : b + batch_size])
        for lv in range(cfg.levels):
            e = model.codebooks[lv]
            idx = sq_dists(r, e).argmin(1)
            usage[lv] += torch.bincount(idx, minlength=cfg.codebook_size)
            r = r - e[idx]
    return usage


def with_overrides(config: RQVAEConfig, **overrides: Any) -> RQVAEConfig:
    """``config`` with the non-None overrides applied (CLI flags that were not given stay as they are)."""
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})
