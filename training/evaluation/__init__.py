"""Offline evaluation: ranking a split's users, metrics beside baselines, paired comparisons."""
