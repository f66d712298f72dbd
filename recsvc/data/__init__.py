"""The split data format and offline scoring, shared by serving, benchmarks and training (torch-free).

- ``split``: the data directory format (``load_split_dir`` -> ``SplitData``, ``EvalUser``, ``ItemMeta``)
- ``sampling``: the seeded user sample every evaluation and benchmark draws (``sample_users``)
- ``metrics``: Recall / NDCG@K, cold / warm slices, lists read per cutoff (``evaluate_rankings``, ``score_lists``)
"""
