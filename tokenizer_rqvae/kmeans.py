"""Seeded k-means (faiss) for codebook initialisation.

faiss needs at least k training points; with fewer (a tiny catalog, a first batch smaller than the codebook)
every point becomes a centroid and the remaining ``k - n`` centroids are points drawn with replacement plus
small Gaussian noise, so no two centroids coincide and each is still near the data. Example: ``n = 3, k = 5``
-> centroids = the 3 points + 2 noisy copies of randomly drawn points.
"""

from __future__ import annotations

import numpy as np

NOISE_SCALE = 1e-2  # noise std relative to the per-dimension std of the data (or 1e-3 absolute)


def kmeans(x: np.ndarray, k: int, niter: int = 20, seed: int = 0, max_points_per_centroid: int = 256,
           threads: int | None = None) -> np.ndarray:
    """x [n, d] -> centroids [k, d] float32 (deterministic for ``seed``); ``threads`` None = all cores."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"kmeans needs a non-empty [n, d] array, got shape {x.shape}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n, d = x.shape
    rng = np.random.default_rng(seed)
    if n <= k:
        return _pad_with_noisy_samples(x, k, rng)
    distinct = np.unique(x, axis=0)
    if distinct.shape[0] <= k:  # faiss would leave empty clusters: every distinct point is a centroid
        return _pad_with_noisy_samples(distinct, k, rng)
    import faiss

    from tokenizer_rqvae.embed import available_cores

    faiss.omp_set_num_threads(threads or available_cores())
    km = faiss.Kmeans(d, k, niter=niter, seed=int(seed) % (2**31), verbose=False,
                      max_points_per_centroid=max_points_per_centroid, spherical=False)
    km.train(x)
    return np.asarray(km.centroids, dtype=np.float32).reshape(k, d)


def _pad_with_noisy_samples(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """x [n, d] with n <= k -> [k, d]: x, then k - n noisy copies of rows drawn with replacement."""
    n, d = x.shape
    extra = k - n
    if extra == 0:
        return x.copy()
    picks = x[rng.integers(0, n, size=extra)]  # [extra, d]
    std = x.std(axis=0) if n > 1 else np.zeros(d, dtype=np.float32)
    scale = np.where(std > 0, std * NOISE_SCALE, 1e-3).astype(np.float32)  # [d]
    noise = rng.standard_normal((extra, d)).astype(np.float32) * scale
    return np.concatenate([x, picks + noise], axis=0).astype(np.float32)
