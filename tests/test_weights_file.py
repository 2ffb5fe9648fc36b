"""The package weights file (package/weights.py) and the chunked hashes (package/manifest.py)."""

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from aotgen.package.manifest import sha256_chunks
from aotgen.package.weights import ALIGN, is_padding, save_aligned


def test_every_tensor_is_aligned_and_round_trips(tmp_path):
    tensors = {
        "a.bias": torch.randn(3),  # 12 bytes: the next tensor needs a filler
        "b.int8": torch.randint(-128, 127, (5, 7), dtype=torch.int8),
        "c.bf16": torch.randn(9, dtype=torch.float64).to(torch.bfloat16),
        "d.scalar": torch.tensor(2.5),
        "e.empty": torch.zeros(0, 4),
        "f.view": torch.arange(20.0).reshape(4, 5)[:, 1:3],  # non-contiguous input
    }
    path = tmp_path / "w.safetensors"
    save_aligned(tensors, path)
    loaded = load_file(str(path))  # the reference reader accepts the file
    assert any(is_padding(n) for n in loaded)
    real = {n: t for n, t in loaded.items() if not is_padding(n)}
    assert set(real) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(real[name], t), name
        if real[name].numel():
            assert real[name].data_ptr() % ALIGN == 0, name


def test_reserved_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        save_aligned({"__pad0": torch.zeros(1)}, tmp_path / "w.safetensors")


@pytest.mark.parametrize("size", [0, 1, 1000, 4096])
def test_chunk_hashes_equal_hashes_of_the_pieces(tmp_path, size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    chunk = 1000
    expected = [hashlib.sha256(data[i : i + chunk]).hexdigest() for i in range(0, size, chunk)]
    assert sha256_chunks(path, chunk) == (expected or [hashlib.sha256(b"").hexdigest()])
