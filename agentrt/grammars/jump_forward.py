"""Jump-forward decoding: tokens for the text a grammar forces next (SGLang's compressed-FSM
jump-forward, Zheng et al. 2024, arXiv 2312.07104), tokenized the way the model would.
"""

from __future__ import annotations


def forced_token_ids(tokenizer, token_texts: list[str | None], last_id: int, forced: str) -> list[int]:
    """Token ids to append after `last_id` for the forced text, or [] when that is not safe.

    tokenizer: a Hugging Face tokenizer (byte-level BPE or SentencePiece); token_texts: the text of
    each token id (None for special and partial-UTF-8 tokens); last_id: the last sampled token;
    forced: the string the grammar allows next (xgrammar's `find_jump_forward_string`).

    Only the forced text's canonical tokens are used, and only when they spell it exactly and
    retokenizing the last token plus the forced text gives back `[last_id, *ids]` (nothing merges
    across the boundary). The last forced token is left out: the model may extend it into free text
    (`"na` + `me` vs `"name`), so the appended sequence stays one the tokenizer itself produces.
    """
    last = token_texts[last_id] if 0 <= last_id < len(token_texts) else None
    if not forced or last is None:
        return []
    ids = tokenizer.encode(forced, add_special_tokens=False)
    if "".join(token_texts[i] or "\0" if i < len(token_texts) else "\0" for i in ids) != forced:
        return []
    if tokenizer.encode(last + forced, add_special_tokens=False) != [last_id, *ids]:
        return []
    return ids[:-1]
