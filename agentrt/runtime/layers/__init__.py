"""Shared decoder layers the model families are written over (models/): norms, rotary embeddings,
attention, gated MLPs and a sparse MoE block. Their element-wise ops (the C++ CPU ops at float32
where they are loaded, the batch-invariant Triton norm, else torch) are a `forward.LayerOps` given to
each layer when the model is built; attention reaches the KV pool only through the forward's
`forward.ForwardMeta` (`rope_and_store`, `attend`, `layer_view`)."""
