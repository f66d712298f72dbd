"""The recommender's pipeline: decoding (the engine's plain / strict / relaxed entry, the rules' list-level
search or the prior's ranking alone) and then list stages, each one concept with a typed input and output."""
