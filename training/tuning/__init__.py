"""The tunings: validation searches that choose the served settings (prior, mix, history, dense, fresh)."""
