"""Random walks through a compiled grammar with the default tokenizer's tokens."""

from __future__ import annotations

import random

import numpy as np

SPIDER_WALK_DBS = ["car_1", "dog_kennels", "flight_2", "network_1", "student_transcripts_tracking", "world_1"]


def token_walks(backend, compiled, seed: int, n: int, budget: int = 150, stop_p: float = 0.7) -> list[str]:
    """Up to n queries from uniformly random allowed tokens of the default tokenizer: each step
    takes any token the grammar's mask allows; where the grammar may end, the walk ends with
    probability stop_p; a walk that has not ended after `budget` tokens is dropped. Text is the
    tokens' exact bytes."""
    texts = [bytes(b) for b in backend.info.decoded_vocab]
    rng = random.Random(seed)
    bitmask = backend.allocate_bitmask(1)
    stop = backend.stop_ids[0]
    out = []
    for _ in range(n):
        m = backend.new_matcher(compiled)
        ids: list[int] = []
        while len(ids) < budget:
            m.fill_next_token_bitmask(bitmask, 0)
            bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[: len(texts)]
            allowed = np.flatnonzero(bits)
            if stop in allowed and rng.random() < stop_p:
                out.append(b"".join(texts[i] for i in ids).decode())
                break
            rest = allowed[allowed != stop]
            choice = int(rng.choice(rest if len(rest) else allowed))
            assert m.accept_token(choice)
            ids.append(choice)
    return out
