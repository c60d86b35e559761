"""Chained block keys for the prefix tiers below the radix tree.

A token sequence is cut into blocks of `block_tokens` tokens from its start; block i's key is a hash
of block i-1's key and block i's token ids, and block 0's parent is a root key made from the cache
namespace (`salt`). So a key names a whole prefix (every token up to the block's end, in its
namespace) in 16 bytes, any tier can hold any block without a tree, and the same prompt finds the
same keys after a restart (the scheme vLLM's prefix caching and LMCache use for the same reason).
A trailing partial block (a finished request's last < block_tokens tokens, written through to disk
so a returning prompt resumes exactly where it stopped) has a `tail_key` of its own, in another hash
domain, under the key of the full block before it. A recurrent-state snapshot after the tokens up to
a block's end (a hybrid model's, runtime/recurrent_state.py) is kept under that block's `state_key`.
"""

from __future__ import annotations

import hashlib
from array import array

KEY_BYTES = 16


def root_key(salt: str) -> bytes:
    """The parent key of block 0 in namespace `salt` (a tenant's `cache_salt`; "" = shared)."""
    # surrogatepass: any str has a key (a lone surrogate from a JSON "\\ud800" never raises here)
    return hashlib.blake2b(
        b"agentrt-kv-root\x00" + salt.encode("utf-8", "surrogatepass"), digest_size=KEY_BYTES
    ).digest()


def block_key(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """Key of a block of token ids under its parent key. Raises OverflowError for a token id
    outside [0, 2**32)."""
    return hashlib.blake2b(parent + array("I", tokens).tobytes(), digest_size=KEY_BYTES).digest()


def tail_key(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """Key of a trailing partial block (fewer tokens than a block) under its parent key; never equal
    to a block_key (its own hash domain). Raises OverflowError for a token id outside [0, 2**32)."""
    return hashlib.blake2b(
        b"agentrt-kv-tail\x00" + parent + array("I", tokens).tobytes(), digest_size=KEY_BYTES
    ).digest()


def state_key(key: bytes) -> bytes:
    """Key of the recurrent-state snapshot after the tokens up to the end of the (full or partial)
    block with key `key`; in its own hash domain (never a block's key)."""
    return hashlib.blake2b(b"agentrt-state\x00" + key, digest_size=KEY_BYTES).digest()


def chain_keys(token_ids: list[int], salt: str, block_tokens: int) -> list[bytes]:
    """Keys of every full block of `token_ids` (len(token_ids) // block_tokens of them), from block 0
    (a key depends on every earlier token). Raises ValueError when block_tokens < 1."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    keys: list[bytes] = []
    parent = root_key(salt)
    for b in range(len(token_ids) // block_tokens):
        parent = block_key(parent, token_ids[b * block_tokens : (b + 1) * block_tokens])
        keys.append(parent)
    return keys
