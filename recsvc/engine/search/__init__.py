"""The target's own searches over the trie, no drafter: plain constrained beam search (the reference the
speculative searches reproduce) with its bounded last step, sampling beam search (relaxed's baseline) with the
per-request noise it draws ahead, and transformers' ``generate`` with the trie callback (the outside reference)."""
