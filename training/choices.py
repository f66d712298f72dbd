"""Training's choices, one table each (torch-free: the CLI lists them without loading torch)."""

METHODS = ("sft", "wordkd", "tvdkd", "seqkd", "atspeed-s", "atspeed-r")  # drafter training objectives
TEACHER_METHODS = METHODS[1:]  # methods that need teacher data (BUNDLE/teacher)
SUPPORTS = ("topk", "trie")  # atspeed-r's TVD support: V_c (the spec) or every trie-allowed code (w/o CA)
VERIFY = ("auto", "strict", "relaxed")  # the acceptance a drafter is selected on
TUNING_METRICS = ("ndcg@10", "recall@10")  # what the tunings rank their candidates by
BF16_MODES = ("auto", "on", "off")  # bf16 autocast in training
# AdamW: the fused kernel, or torch's default implementation (foreach on CUDA, a per-tensor loop on the CPU;
# the recipe's optimizer before the fused one)
OPTIMIZERS = ("fused", "foreach")
REFIT_MODES = ("continue", "scratch")  # a deploy refit: from the fitted weights, or from scratch
ALIGN_MODES = ("none", "text2id")  # the target's auxiliary alignment task
PROTOCOLS: tuple[str, ...] = ("paper", "deploy")  # paper: fit on train; deploy: refit on train+valid
FIT_PERIODS: tuple[str, ...] = ("train", "train+valid")  # the periods a model is fitted on
