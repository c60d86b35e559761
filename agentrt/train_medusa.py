"""`agentrt train-medusa`: self-distil Medusa heads for a model (Medusa-1: the model stays frozen).

1. Each prompt of the JSONL file (`{"messages": [...]}` chat or `{"prompt": "..."}` text, with an
   optional `"schema"`: the response is then generated under that JSON Schema, as an extraction
   job would) is answered by the model itself, greedily, in batches through the engine.
2. Prompt + response run through the model once more to get the final hidden state at every
   response position (and the last prompt position).
3. Head k learns the token k + 2 positions ahead from those states (speculative/medusa.py,
   `train_heads`); the last 10% of positions are held out for a top-1 accuracy report.

The heads are written in Medusa's checkpoint layout with `shared_lm_head: true`, plus the training
record (prompt file, counts, hyper-parameters, held-out accuracy) in config.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.backends import run_chunks
from agentrt.runtime.config import EngineConfig
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.request import SamplingParams
from agentrt.speculative.medusa import MedusaHeads, head_targets, train_heads


def read_prompts(path: Path, tokenizer) -> list[tuple[list[int], ConstraintSpec | None]]:
    """(prompt ids, constraint) per line. Raises ValueError naming the line when it is not a JSON
    object with `messages` or `prompt`."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(item, dict) or not ("messages" in item or "prompt" in item):
            raise ValueError(f"{path}:{n}: expected an object with 'messages' or 'prompt'")
        if "messages" in item:
            text = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=False)
        else:
            text = item["prompt"]
        ids = tokenizer.encode(text, add_special_tokens=False)
        spec = ConstraintSpec.json_schema(item["schema"]) if item.get("schema") is not None else None
        out.append((ids, spec))
    if not out:
        raise ValueError(f"{path} has no prompts")
    return out


def train_medusa(config: EngineConfig, args: argparse.Namespace, log=print) -> dict:
    """Generate, collect hidden states, train, save (see the module docstring). Returns the record
    written into config.json."""
    from agentrt.runtime.engine import Engine

    engine = Engine(config)
    try:
        prompts = read_prompts(Path(args.prompts), engine.tokenizer)
        t0 = time.perf_counter()
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        outs = engine.generate([(ids, params, spec) for ids, spec in prompts])
        log(
            f"generated {sum(len(o.token_ids) for o in outs)} response tokens for {len(prompts)} prompts "
            f"in {time.perf_counter() - t0:.0f} s"
        )
        runner = engine.runner
        hidden_rows, target_rows = [], []
        for (ids, _), out in zip(prompts, outs):
            seq = ids + list(out.token_ids)
            start = len(ids)
            slots = runner.kv.allocate(len(seq))
            if slots is None and engine.scheduler.make_room(len(seq)):  # the prefix cache holds the pool
                slots = runner.kv.allocate(len(seq))
            if slots is None:
                raise ValueError(f"a prompt + response of {len(seq)} tokens does not fit the KV pool")
            runner.kv.sync_map()
            try:
                chunk = SeqChunk(seq, 0, slots, True, len(seq) - start + 1)
                _, hidden = run_chunks(
                    runner.model,
                    runner.kv.k,
                    runner.kv.v,
                    [chunk],
                    runner.device,
                    True,
                    swa_map=runner.kv.swa_map,
                )
            finally:
                runner.kv.free(slots)
            hidden_rows.append(hidden.float().cpu())
            target_rows.append(head_targets(seq, args.num_heads, start)[:, start - 1 :])
        hidden = torch.cat(hidden_rows)
        targets = torch.cat(target_rows, dim=1)
        log(f"{hidden.shape[0]} positions of hidden size {hidden.shape[1]}")
        arch = runner.arch
        torch.manual_seed(args.seed)
        heads = MedusaHeads(arch.hidden_size, arch.vocab_size, args.num_heads)
        result = train_heads(
            heads,
            hidden,
            targets,
            runner.model.lm_head.weight.float().cpu(),
            epochs=args.epochs,
            lr=args.lr,
            batch_size=args.batch_size,
            seed=args.seed,
            log=log,
        )
    finally:
        engine.grammar.shutdown()
    record = {
        "model": config.model.model,
        "prompts_file": Path(args.prompts).name,
        "num_prompts": len(prompts),
        "num_positions": int(hidden.shape[0]),
        "max_tokens": args.max_tokens,
        "epochs": args.epochs,
        "lr": args.lr,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "holdout_top1": [round(x, 4) for x in result["holdout_top1"]],
        "train_loss": [round(x, 4) for x in result["train_loss"]],
        "date": time.strftime("%Y-%m-%d"),
    }
    heads.save(args.output, {"training": record})
    log(f"saved {args.num_heads} heads to {args.output}; held-out top-1 per head: {record['holdout_top1']}")
    return record
