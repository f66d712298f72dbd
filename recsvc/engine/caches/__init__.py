"""A request's KV rows: the prompt batch, its prefill (with the user-state cache, so a returning user's prompt
does not run again), and the rows the generated tokens are fed into: plain beam search's beams
(``beam_cache``) and trie-node trees reused across steps and rounds (``tree_cache``)."""
