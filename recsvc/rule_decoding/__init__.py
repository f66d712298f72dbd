"""Rule-aware decoding (docs/RULES.md), the decoding level of the rules: the list-level beam search under caps and
boosts (search.py), its look-aheads (lookahead.py) and the strategies that choose among them (decode.py). The
Rules values and the item attributes over the trie are recsvc.rules, below the engine."""
