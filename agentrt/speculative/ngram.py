"""N-gram prompt lookup proposer (Saxena 2023, "Prompt Lookup Decoding"; vLLM's `ngram` method).

Outputs of extraction and agent jobs copy spans of their input (names, numbers, keys). The proposer
takes the last n tokens of prompt + output, finds their most recent earlier occurrence in the same
sequence and proposes the k tokens that followed it. It tries n from `max_n` down to `min_n`
(a longer match predicts better); no match gives no draft.
"""

from __future__ import annotations


class NgramProposer:
    """min_n, max_n: n-gram lengths tried (1 <= min_n <= max_n); k: tokens proposed at most.
    Raises ValueError on invalid sizes."""

    def __init__(self, k: int, min_n: int = 1, max_n: int = 4):
        if not (1 <= min_n <= max_n) or k < 1:
            raise ValueError(
                f"n-gram proposer needs 1 <= min_n <= max_n and k >= 1, got {min_n}, {max_n}, {k}"
            )
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """token_ids: the whole sequence (prompt + output). Returns up to k (default self.k) token
        ids that followed the latest earlier occurrence of the longest matching suffix n-gram;
        [] when no suffix of length min_n..max_n occurs earlier. O(len(token_ids) x max_n)."""
        k = self.k if k is None else k
        total = len(token_ids)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = token_ids[total - n :]
            first = suffix[0]
            # latest start i < total - n with token_ids[i:i+n] == suffix, scanning backwards
            for i in range(total - n - 1, -1, -1):
                if token_ids[i] == first and token_ids[i : i + n] == suffix:
                    follow = token_ids[i + n : i + n + k]
                    if follow:
                        return list(follow)
                    break
        return []
