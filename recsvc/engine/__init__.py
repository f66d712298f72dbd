"""Decoding over the catalog trie: the engine knows no bundle, drafter class, rule or service; it decodes with the
models and the drafter session it is handed. Its rooms, in the order a request passes through them (each room
imports only the rooms listed after it):

- ``entry``: the one decoding entry (``dispatch.decode``: a batch in one mode -> the search that runs), the
  record of the path that ran (``modes``) and the final read of the lists to the host;
- ``speculation``: draft-then-verify searches over a drafter's session: the ports drafters implement, the
  shared round bookkeeping and the (N, gamma) autotuner; ``strict/`` (lossless top-K verification) and
  ``relaxed/`` (sampling verification), each with its sync-free unrolled form;
- ``search``: the target's own searches: plain constrained beam search (the reference) and its bounded last
  step, sampling beam search and its per-request noise, transformers' ``generate`` as the outside reference;
- ``caches``: a request's KV rows: the prompt batch, its prefill with the user-state cache, the rows of plain
  beams and of trie-node trees;
- ``kernels``: the forwards: the forward plan, the one decoder layer and its attentions, the lean and fast
  forwards and their shared pieces, static buckets, CUDA graphs, compile strategies, ``EngineModel``;
- ``scoring``: one step over the trie: every allowed child's score (the fused prior's step term included) and
  the selection of the best (generate's tie-breaks);
- ``meters``: what a search costs, counted beside it without changing it: phase timers, host reads, launches.
"""
