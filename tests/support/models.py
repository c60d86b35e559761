"""Tiny random-weight models, chat prompts as token ids, and stepping an engine to the end."""

from __future__ import annotations

from pathlib import Path


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template (generation prompt added)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def make_tiny_model(path: Path, tokenizer_dir: Path, arch: str, **overrides) -> Path:
    """Save a random-weight 2-layer model of `arch` (llama | qwen2 | mistral) with the default
    model's tokenizer into `path`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    kwargs = {
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**kwargs), dtype=torch.float32)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    return path


def finish_all(engine, requests) -> list:
    """Step `engine` until every one of `requests` has finished; their final outputs, in order."""
    final = {}
    while len(final) < len(requests):
        final.update({out.request_id: out for out in engine.step() if out.finished})
    return [final[req.request_id] for req in requests]


def chunked_logits_error(runner, hf, ids: list[int], prefill: int, chunk_end: int, seq_key=None) -> float:
    """Max |logit| difference between `runner` and the transformers model `hf` on `ids`: a prefill of
    `prefill` tokens, a chunk on top of the cache up to `chunk_end`, then single-token decodes to the
    end (the logits of each step's last token against transformers' full forward). A model with
    recurrent layers carries its state in one state slot across the three."""
    import functools

    import torch

    from agentrt.runtime.forward import SeqChunk

    n = len(ids)
    slots = runner.kv.allocate(n)
    state = runner.kv.states.allocate() if runner.kv.states is not None else None
    chunk = functools.partial(SeqChunk, seq_key=seq_key, state_slot=state)
    got = [runner.execute([chunk(ids[:prefill], 0, slots[:prefill])])]
    got.append(runner.execute([chunk(ids[prefill:chunk_end], prefill, slots[:chunk_end])]))
    for i in range(chunk_end, n):
        got.append(runner.execute([chunk([ids[i]], i, slots[: i + 1])]))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    expected = ref[[prefill - 1, chunk_end - 1, *range(chunk_end, n)]]
    return (torch.cat(got) - expected).abs().max().item()
