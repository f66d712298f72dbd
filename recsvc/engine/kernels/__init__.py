"""The forwards and how they run: the forward plan resolved once from the flags, the one LLaMA decoder layer and
its attentions, the lean forward (transformers' bits) and the fast forward with the pieces they share, bucketed
static shapes, CUDA graph capture, the compile strategies (the layer stack, one layer, a step's scoring) and
``EngineModel``, one per model, the single primitive the searches call."""
