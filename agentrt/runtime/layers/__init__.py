"""Shared decoder layers the model families are written over (models/): norms, rotary embeddings,
attention, gated MLPs and a sparse MoE block. Each layer picks its kernel itself from the batch's
attention metadata (`ops_fused`): the C++ CPU ops at float32 where they are loaded, else torch."""
