"""The prefix tiers below the radix tree: a host tier (in memory) and a disk tier, each an LRU of
encoded KV blocks under a byte limit, keyed by the chained block keys of block_keys.py.

A block is `block_tokens` tokens of KV rows in the pool's own dtype (every per-slot tensor of the
pool, concatenated as bytes, see runtime/kv_tiers.py), encoded losslessly by `BlockCodec` (blosc2:
byte shuffle + zstd level 1, or stored as is), so a block loaded back is bit-identical to the rows
that went down. Both tiers are thread-safe (the engine thread looks up, a store thread writes, a
load thread reads).

Disk layout: one file per block, `<key hex>.kvb`, written to a temporary name and renamed into place
(a reader never sees half a file), with a header (magic, version, the KV fingerprint, key, token
count, CRC-32 of the tokens and payload), the block's token ids (uint32) and the payload. A file
that fails any check is skipped and deleted, never loaded. `FINGERPRINT` in the directory names the
model, weights and KV layout the files belong to; on a mismatch the files are discarded with a
warning, and a FINGERPRINT that is not one agentrt writes (garbage) is overwritten with a warning,
whether or not there are files to discard.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"AKVB"
VERSION = 1
_HEADER = struct.Struct("<4sI16s16sIIQ")  # magic, version, fingerprint, key, num_tokens, crc32, payload bytes
ENTRY_OVERHEAD = 160  # bytes of bookkeeping per host entry, counted against the host tier's limit


@dataclass(frozen=True)
class Block:
    """An encoded KV block: `key` (16 bytes, block_keys.chain_keys), its token ids and `blob`, the
    codec's encoding of the block's KV rows."""

    key: bytes
    tokens: tuple[int, ...]
    blob: bytes

    @property
    def nbytes(self) -> int:
        return len(self.blob) + 4 * len(self.tokens) + ENTRY_OVERHEAD


class BlockCodec:
    """Lossless encoding of a block's bytes. `name`: "zstd" (blosc2 byte shuffle with `typesize`,
    then zstd level 1) or "none". Raises ValueError for another name."""

    def __init__(self, name: str = "zstd", typesize: int = 4):
        if name not in ("zstd", "none"):
            raise ValueError(f"KV tier compression must be zstd or none, got {name!r}")
        self.name, self.typesize = name, typesize
        if name == "zstd":
            import blosc2

            self._blosc2 = blosc2

    def encode(self, raw: bytes | memoryview) -> bytes:
        if self.name == "none":
            return bytes(raw)
        b = self._blosc2
        return b.compress2(
            raw, codec=b.Codec.ZSTD, clevel=1, filters=[b.Filter.SHUFFLE], typesize=self.typesize, nthreads=1
        )

    def decode(self, blob: bytes | memoryview, out: memoryview | None = None) -> bytes | memoryview:
        """The raw bytes of `blob`; with `out` (a writable buffer of exactly the raw size, e.g. a
        numpy view of a tensor row) decoded into it, in place, and `out` returned. ValueError when
        the decoded size is not out's."""
        if self.name == "none":
            if out is None:
                return blob
            if len(blob) != len(out):
                raise ValueError(f"a KV block decoded to {len(blob)} bytes, expected {len(out)}")
            out[:] = blob
            return out
        if out is None:
            return self._blosc2.decompress2(blob)
        size = self._blosc2.get_cbuffer_sizes(blob)[0]
        if size != len(out):
            raise ValueError(f"a KV block decoded to {size} bytes, expected {len(out)}")
        self._blosc2.decompress2(blob, dst=out)
        return out


class HostTier:
    """In-memory LRU of blocks holding at most `budget_bytes` (Block.nbytes each)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._entries: OrderedDict[bytes, Block] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Block | None:
        """The block (marked most recently used), or None."""
        with self._lock:
            block = self._entries.get(key)
            if block is not None:
                self._entries.move_to_end(key)
            return block

    def touch(self, key: bytes) -> bool:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            return False

    def put(self, block: Block) -> list[Block]:
        """Insert (or refresh) a block; returns the blocks evicted to stay within the limit (least
        recently used first). A block larger than the whole limit is not kept (returned)."""
        if block.nbytes > self.budget_bytes:
            return [block]
        with self._lock:
            old = self._entries.pop(block.key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[block.key] = block
            self.nbytes += block.nbytes
            evicted = []
            while self.nbytes > self.budget_bytes:
                _, gone = self._entries.popitem(last=False)
                self.nbytes -= gone.nbytes
                evicted.append(gone)
            return evicted

    def keys_lru(self) -> list[bytes]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)


class DiskTier:
    """Blocks in files under `directory`, at most `budget_bytes` of them (file sizes), LRU by use
    (file mtimes order them after a restart). `fingerprint` (16 bytes) and `describe` (shown in
    FINGERPRINT) name the KV the files hold. When the directory cannot be created or written, or a
    write fails (e.g. a full disk), the tier turns itself off with a warning (`enabled` False) and
    every call after that is a miss or a no-op: requests never fail for it."""

    def __init__(
        self, directory: str | os.PathLike, budget_bytes: int, fingerprint: bytes, describe: str = ""
    ):
        self.dir = Path(directory)
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self.enabled = True
        self.nbytes = 0
        self.num_discarded = 0  # files dropped at start (other fingerprint) or on a failed check
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU order
        self._lock = threading.Lock()
        try:
            self._open(describe)
        except OSError as e:
            self._disable(f"cannot use {self.dir} ({e})")

    # ---- start -----------------------------------------------------------------------------
    def _open(self, describe: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for tmp in self.dir.glob("*.tmp"):  # a write cut short by a crash
            # (not a directory someone put here, nor a write under way in another store)
            if (tmp.is_file() or tmp.is_symlink()) and _stale_tmp(tmp):
                tmp.unlink(missing_ok=True)
        stamp = self.dir / "FINGERPRINT"
        want = f"{self.fingerprint.hex()}\n{describe}\n"
        raw = stamp.read_bytes() if stamp.is_file() else None
        have = None if raw is None else raw.decode("utf-8", "replace")
        # block files only: not symlinks (a dangling one has no mtime), not directories
        files = []
        for p in self.dir.glob("*.kvb"):
            try:  # a file another store deletes meanwhile is skipped, not an error
                if p.is_file() and not p.is_symlink():
                    files.append((p.stat().st_mtime_ns, p))
            except OSError:
                continue
        files = [p for _, p in sorted(files)]
        theirs = _stamp_fingerprint(have)
        if have is not None and theirs is None:  # not a FINGERPRINT this class writes
            logger.warning(
                "KV disk tier %s: its FINGERPRINT file is not one agentrt writes (%s); overwriting it%s",
                self.dir,
                _preview(raw),
                f" and discarding the {len(files)} block file{'s' * (len(files) > 1)} it cannot vouch for"
                if files
                else "",
            )
        if theirs != self.fingerprint.hex():
            if files and (theirs is not None or have is None):
                logger.warning(
                    "KV disk tier %s: %d files belong to another model, weights or KV layout (%s); "
                    "discarding them",
                    self.dir,
                    len(files),
                    "no FINGERPRINT file" if have is None else (have.split("\n")[1] or "no description"),
                )
            for f in files:
                f.unlink(missing_ok=True)
            self.num_discarded += len(files)
            files = []
            self._write_atomic(stamp, want.encode())
        for f in files:
            try:
                key = bytes.fromhex(f.stem)
                size = f.stat().st_size
            except (ValueError, OSError):
                continue
            if len(key) == len(self.fingerprint):
                self._index[key] = size
                self.nbytes += size
        self._trim()

    # ---- access ----------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return self.enabled and key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.kvb"

    def put(self, block: Block) -> bool:
        """Write a block (atomically); False when the tier is off or the write failed (the tier is
        then turned off with a warning)."""
        if not self.enabled:
            return False
        if block.key in self._index:
            self.touch(block.key)
            return True
        tokens = struct.pack(f"<{len(block.tokens)}I", *block.tokens)
        crc = zlib.crc32(block.blob, zlib.crc32(tokens))
        header = _HEADER.pack(
            MAGIC, VERSION, self.fingerprint, block.key, len(block.tokens), crc, len(block.blob)
        )
        data = header + tokens + block.blob
        try:
            self._write_atomic(self._path(block.key), data)
        except OSError as e:
            self._disable(f"write to {self.dir} failed ({e})")
            return False
        with self._lock:
            self._index[block.key] = len(data)
            self.nbytes += len(data)
        self._trim()
        return True

    def get(self, key: bytes) -> Block | None:
        """Read and check a block; None when absent, off, or the file fails a check (torn,
        corrupt, another fingerprint or key: it is deleted and counted in num_discarded)."""
        if not self.enabled or key not in self._index:
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self._drop(key, path, "unreadable")
            return None
        block = self._parse(key, data)
        if block is None:
            self._drop(key, path, "failed its check")
            return None
        self.touch(key)
        return block

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        try:
            os.utime(self._path(key))
        except OSError:
            pass

    def _parse(self, key: bytes, data: bytes) -> Block | None:
        if len(data) < _HEADER.size:
            return None
        magic, version, fp, k, n, crc, payload = _HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION or fp != self.fingerprint or k != key:
            return None
        if len(data) != _HEADER.size + 4 * n + payload:
            return None
        view = memoryview(data)  # slices without copying the payload
        tokens = view[_HEADER.size : _HEADER.size + 4 * n]
        blob = view[_HEADER.size + 4 * n :]
        if zlib.crc32(blob, zlib.crc32(tokens)) != crc:
            return None
        return Block(key, struct.unpack(f"<{n}I", tokens), blob)

    # ---- upkeep ----------------------------------------------------------------------------
    def _drop(self, key: bytes, path: Path, why: str) -> None:
        logger.warning("KV disk tier: %s %s; skipped and deleted", path.name, why)
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.nbytes -= size
        self.num_discarded += 1
        _remove(path)

    def _trim(self) -> None:
        """Delete least recently used files until within the byte limit."""
        while True:
            with self._lock:
                if self.nbytes <= self.budget_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self.nbytes -= size
            _remove(self._path(key))

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f"{path.name}.{_HOST}-{os.getpid()}-{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _disable(self, why: str) -> None:
        if self.enabled:
            logger.warning("KV disk tier off: %s; the tiers above keep serving", why)
        self.enabled = False


def _stamp_fingerprint(text: str | None) -> str | None:
    """The fingerprint (hex digits) a FINGERPRINT file's text names: its first line, when the text has
    the form DiskTier writes (`<fingerprint hex>\\n<description>\\n`); None otherwise (garbage)."""
    first, sep, _ = (text or "").partition("\n")
    if not sep or not first or first.strip("0123456789abcdef"):
        return None
    return first


def _preview(data: bytes, limit: int = 48) -> str:
    """The first `limit` bytes of `data` for a log line (repr: other than printable ASCII escaped)."""
    return repr(data[:limit]) + (f" ... ({len(data):,} bytes)" if len(data) > limit else "")


STALE_TMP_SECONDS = 600.0  # a block write takes milliseconds: a temporary file this old is dead


def _host_code() -> str:
    """8 hex digits naming this host and PID namespace (containers sharing a hostname and a volume
    have their own PIDs: a PID is only asked about within its own namespace)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{zlib.crc32(f'{socket.gethostname()}/{namespace}'.encode()):08x}"


_HOST = _host_code()  # writers on a shared directory's hosts


def _stale_tmp(tmp: Path) -> bool:
    """Whether a `<name>.<host>-<pid>-<thread>.tmp` file is left over from a write that will never
    finish: its writer process on this host is gone, or it is older than STALE_TMP_SECONDS (a name
    we cannot parse, or a writer on another host sharing the directory). A live writer's file
    (another replica's, or another engine's in this process) is left alone: deleting it would fail
    that write's rename and turn that store's disk tier off."""
    try:
        age = time.time() - tmp.lstat().st_mtime
    except OSError:
        return False
    if age > STALE_TMP_SECONDS:
        return True
    host, _, rest = tmp.name.rsplit(".", 2)[-2].partition("-")
    pid = rest.partition("-")[0]
    if host != _HOST or not (pid.isascii() and pid.isdigit()):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError, ValueError):  # alive under another user, or not a pid to ask about
        return False
    return False


def _remove(path: Path) -> None:
    """Delete a block file; one that cannot be deleted (replaced by a directory, say) is left, with
    a warning: it is out of the index already, so the tier carries on without it."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("KV disk tier: cannot delete %s (%s); left in place", path, e)
