"""A peer snapshot's file: the states' structure pickled, their tensors' bytes raw after it.

torch.save would do, but its zip writer computes a CRC32 of every byte and copies the data once
more (38 ms of CPU for 16 MB on the test VM, against 8 ms for writing the same bytes into
/dev/shm as they are), which a snapshot of every step pays on the CPUs the training needs. Here the structure is one
small pickle, each tensor stands in it as an offset, and the tensors' own memory goes to the
kernel as it is. A snapshot never leaves the run's nodes and is read back by the jobgen that
wrote it; the checkpoint it becomes on a restart is written by torch.save and hashed as any.

    MAGIC | pickle length | data length (8 bytes each, little-endian) | pickle | data

Tensor data starts at multiples of ALIGN from the data's start, which starts at one too.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

MAGIC = b"JGSNAP1\n"
HEADER = struct.Struct("<8sQQ")
ALIGN = 64


def pieces(value: Any) -> list:
    """The file's bytes as a list of buffers (the tensors' own memory, not copies): write them
    in order. The tensors must not change until they are written."""
    pickler = _Pickler()
    pickler.dump(value)
    structure = pickler.buffer.getvalue()
    data_start = _aligned(HEADER.size + len(structure))
    out: list = [HEADER.pack(MAGIC, len(structure), pickler.length), structure, bytes(data_start - HEADER.size - len(structure))]
    for flat in pickler.tensors:
        out.append(flat.numpy().data)
        if flat.numel() % ALIGN:
            out.append(bytes(_aligned(flat.numel()) - flat.numel()))
    return out


def load(data: Any) -> Any:
    """What `pieces` wrote, from the file's bytes; every tensor a copy of its own."""
    import torch

    view = memoryview(data)
    magic, structure_length, data_length = HEADER.unpack_from(view)
    data_start = _aligned(HEADER.size + structure_length)
    if magic != MAGIC or len(view) != data_start + data_length:
        raise ValueError(f"not a whole snapshot ({len(view)} bytes, expected {data_start + data_length})")
    payload = torch.frombuffer(view[data_start:], dtype=torch.uint8) if data_length else torch.empty(0, dtype=torch.uint8)

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            offset, length, dtype, shape = pid
            return payload[offset:offset + length].clone().view(dtype).reshape(shape)

    return Unpickler(io.BytesIO(view[HEADER.size:HEADER.size + structure_length])).load()


class _Pickler(pickle.Pickler):
    """Pickles everything but plain tensors, which it lists, flattened to bytes, at their offsets."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        super().__init__(self.buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list = []
        self.length = 0

    def persistent_id(self, obj: Any) -> Any:
        import torch

        if type(obj) is not torch.Tensor or obj.layout != torch.strided or obj.is_quantized or obj.device.type != "cpu":
            return None  # pickled as torch pickles it (nothing of the kind in a snapshot so far)
        flat = (obj if obj.is_contiguous() else obj.contiguous()).detach().view(-1).view(torch.uint8)
        pid = (self.length, flat.numel(), obj.dtype, tuple(obj.shape))
        self.tensors.append(flat)
        self.length += _aligned(flat.numel())
        return pid


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
