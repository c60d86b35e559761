"""Shared decoder layers the model families are written over (models/): norms, rotary embeddings,
attention, gated MLPs and a sparse MoE block. Their element-wise ops (the C++ CPU ops at float32
where they are loaded, the batch-invariant Triton norm, else torch) are a `forward.LayerOps` given to
each layer when the model is built; attention reaches the KV pool only through the forward's
`forward.ForwardMeta` (`rope_and_store`, `attend`, `layer_view`).

The recurrent mixers of the hybrid families (gated_delta.py: Gated DeltaNet of Qwen3-Next / Qwen3.5;
mamba2.py: the Mamba-2 mixer of Nemotron-H / Granite 4; their short convolution in causal_conv.py)
keep no KV: they read and update one sequence's state (`state_shapes`) that the caller passes in."""
