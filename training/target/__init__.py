"""The target stage: the causal-LM training loop, its examples, schedule, epoch selection and options."""
