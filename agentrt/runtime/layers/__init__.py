"""Shared decoder layers the model families are written over (models/): norms, rotary embeddings,
attention, gated MLPs and a sparse MoE block. The kernel (the C++ CPU ops at float32 where they are
loaded, else torch) is chosen once per forward by models/base.py's DecoderModel, which sets the
batch's attention metadata `ops_fused`: the attention layer reads it there, and the decoder layer
passes it as the `fused` argument of the norms (`forward_fused`, `add_forward`), the gated MLP and
the MoE block (`forward(x, fused)`)."""
