"""`recsvc report`: plots (PNG and SVG, matplotlib's Agg backend) from the JSON that `recsvc eval`, `recsvc bench
decode|speculative|cache|replay|serve` and a bundle's training record (``training.json``) write."""
