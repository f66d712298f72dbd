"""Item tokenizer: text -> sentence embedding -> RQ-VAE -> collision-free 4-token semantic ids; catalog trie."""
