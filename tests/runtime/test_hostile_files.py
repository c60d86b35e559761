"""Hostile or corrupt model and KV-tier files get an error (or warning) naming what is wrong, both in
`agentrt check` and on the path serve loads a model through (loader.resolve_model_dir): a GGUF whose
header claims counts or lengths the file cannot hold, a config.json that is a symlink loop, a
FINGERPRINT in the KV disk directory that agentrt did not write."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest

from agentrt.cli import main as cli_main
from agentrt.commands.check import check_model
from agentrt.prefix_cache.tier_store import Block, DiskTier
from agentrt.runtime.models.gguf_meta import read_gguf
from agentrt.runtime.models.loader import resolve_model_dir

CPU = {"device": "cpu", "dtype": "float32"}
HUGE = 1 << 40


def _write_gguf(path: Path) -> Path:
    """A small llama GGUF written by the gguf package: a 10-token vocabulary with token types (an
    int32 array), two tensors."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(10)])
    w.add_token_types([1] * 10)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.zeros(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _after(data: bytes, name: str) -> int:
    """The byte right after the (length-prefixed) string `name` in a GGUF header."""
    return data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)


# (what is patched, where it sits in the file, the error's words): each a u64 set to 2**40
HOSTILE = {
    "tensor_count": (lambda d: 8, "the header's tensor_count is 1,099,511,627,776, but the file has only"),
    "metadata_kv_count": (lambda d: 16, "the header's metadata_kv_count is 1,099,511,627,776, but the file"),
    "key length": (lambda d: 24, "the length of the key of metadata entry 0 is 1,099,511,627,776 bytes"),
    "string value length": (
        lambda d: _after(d, "general.architecture") + 4,
        "the length of metadata key 'general.architecture' is 1,099,511,627,776 bytes",
    ),
    "int32 array length": (
        lambda d: _after(d, "tokenizer.ggml.token_type") + 8,
        "the array length of metadata key 'tokenizer.ggml.token_type' (int32) is 1,099,511,627,776",
    ),
    "string array length": (
        lambda d: _after(d, "tokenizer.ggml.tokens") + 8,
        "the array length of metadata key 'tokenizer.ggml.tokens' (string) is 1,099,511,627,776",
    ),
    "tensor dimension": (
        lambda d: _after(d, "token_embd.weight") + 4,
        "the data of tensor 'token_embd.weight' (F32 [10, 1099511627776]: 43,980,465,111,040 bytes at byte",
    ),
}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return _write_gguf(tmp_path_factory.mktemp("gguf") / "base.gguf")


@pytest.mark.parametrize("field", list(HOSTILE))
def test_a_gguf_claiming_more_than_the_file_holds_names_the_field(gguf_file, tmp_path, capsys, field):
    where, words = HOSTILE[field]
    data = bytearray(gguf_file.read_bytes())
    read_gguf(gguf_file)  # the file as written reads
    struct.pack_into("<Q", data, where(bytes(data)), HUGE)
    path = tmp_path / "hostile.gguf"
    path.write_bytes(bytes(data))
    size = f"of its {len(data):,}" if field != "tensor dimension" else f"({len(data):,} bytes)"
    cache = tmp_path / "cache"
    with pytest.raises(ValueError) as serve_error:  # serve's loading path
        resolve_model_dir(str(path), cache)
    message = str(serve_error.value)
    assert message.startswith(f"{path} is not a readable GGUF file: ") and words in message, message
    assert size in message and "unpack_from" not in message
    assert not cache.exists()
    report = check_model(str(path), **CPU)
    assert report.exit_status == 1 and [e.message for e in report.errors] == [message]
    assert cli_main(["check", str(path), "--device", "cpu"]) == 1  # `agentrt check`
    assert message in capsys.readouterr().out


def test_a_gguf_tensor_with_more_dimensions_than_the_file_holds(gguf_file, tmp_path):
    data = bytearray(gguf_file.read_bytes())
    struct.pack_into("<I", data, _after(bytes(data), "output_norm.weight"), 0xFFFFFFFF)
    path = tmp_path / "ndim.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="n_dimensions of tensor 'output_norm.weight' is 4,294,967,295, but"):
        read_gguf(path)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A directory with a tokenizer file and a config.json (the config is looked at first)."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    return d


def test_a_config_json_symlink_loop_is_reported_as_a_loop(model_dir, tmp_path, capsys):
    config = model_dir / "config.json"
    config.unlink()
    config.symlink_to(model_dir / "other.json")
    (model_dir / "other.json").symlink_to(config)
    expected = f"model directory '{model_dir}': its config.json is a symlink loop"
    with pytest.raises(ValueError, match=expected):
        resolve_model_dir(str(model_dir), tmp_path / "cache")
    report = check_model(str(model_dir), **CPU)
    assert report.exit_status == 1 and report.errors[0].message.startswith(expected)
    assert cli_main(["check", str(model_dir), "--device", "cpu"]) == 1
    assert expected in capsys.readouterr().out


def test_a_dangling_config_json_and_a_looping_model_path_say_so(model_dir, tmp_path):
    config = model_dir / "config.json"
    config.unlink()
    config.symlink_to(tmp_path / "gone.json")
    with pytest.raises(ValueError, match=r"config.json is a symlink to .*gone.json, which does not exist"):
        resolve_model_dir(str(model_dir), tmp_path / "cache")
    loop = tmp_path / "loop.gguf"
    loop.symlink_to(loop)
    with pytest.raises(ValueError, match=f"model '{loop}' is a symlink loop"):
        resolve_model_dir(str(loop), tmp_path / "cache")
    report = check_model(str(loop), **CPU)
    assert report.exit_status == 1 and f"model '{loop}' is a symlink loop" in report.errors[0].message


@pytest.mark.parametrize("with_blocks", [False, True])
@pytest.mark.parametrize("garbage", [b"\x00\xff\xfe garbage", b"not a fingerprint\nmodel X\n"])
def test_a_garbage_fingerprint_is_overwritten_with_a_warning(tmp_path, caplog, garbage, with_blocks):
    if with_blocks:
        DiskTier(tmp_path, 1 << 20, b"a" * 16, "model A").put(Block(b"k" * 16, (1,), b"payload"))
    stamp = tmp_path / "FINGERPRINT"
    stamp.write_bytes(garbage)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agentrt.prefix_cache.tier_store"):
        disk = DiskTier(tmp_path, 1 << 20, b"a" * 16, "model A")
    [warning] = [r.getMessage() for r in caplog.records]
    assert f"KV disk tier {tmp_path}: its FINGERPRINT file is not one agentrt writes ({garbage!r})" in warning
    discarding = " and discarding the 1 block file it cannot vouch for" if with_blocks else ""
    assert warning.endswith(f"; overwriting it{discarding}")
    assert disk.enabled and len(disk) == 0 and disk.num_discarded == int(with_blocks)
    assert stamp.read_bytes() == f"{(b'a' * 16).hex()}\nmodel A\n".encode()
    caplog.clear()
    DiskTier(tmp_path, 1 << 20, b"a" * 16, "model A")  # now its own: reopened without a word
    assert not caplog.records


def test_gguf_arrays_nested_past_any_use_are_refused_naming_the_key(tmp_path):
    key = b"general.nested"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    path = tmp_path / "nested.gguf"
    path.write_bytes(header + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 100_000)
    with pytest.raises(
        ValueError,
        match=r"metadata key 'general.nested'\[0\]\[0\]\[0\]\[0\]\[0\]\[0\]\[0\]\[0\] nests arrays more than 8 deep",
    ):
        read_gguf(path)
