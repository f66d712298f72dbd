"""One step of trie-constrained search over given log-probs: every allowed child's score (the trie, the request's
exclusions, the fused item prior's step term) and the selection of the best (tie-breaks as transformers'
``generate``), shared by every search, the drafters and the rules' list-level search."""
