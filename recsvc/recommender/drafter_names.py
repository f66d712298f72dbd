"""The drafters' names (torch-free: a command lists them without loading the engine); the registry that builds
them is ``recsvc.recommender.drafter_registry``."""

DRAFTER_KINDS = ("llama", "head", "transition", "retrieval", "oracle")  # the registry's builders, by name
TAKES_NAME = ("llama", "head")  # kinds that take ":NAME"
HEAD_OPENERS = ("auto", "transition", "none")  # who drafts the head's first round
