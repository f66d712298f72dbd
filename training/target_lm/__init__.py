"""The target stage: the target LM's training loop, its examples, schedule, epoch selection and options.

(Named target_lm/, not target/: build tools and code scanners take a ``target/`` folder for build output and
skip it.)"""
