"""The ids stage: a bundle's semantic ids, built by the RQ-VAE or copied from a given file."""
