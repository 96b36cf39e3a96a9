"""A response's routing as it is stored in the lake: the raw bytes of its [R, L, K] expert ids (one
byte per id up to 256 experts, two beyond) and its shape; 8 bytes a token for 4 layers at top-2."""

from __future__ import annotations

import torch

_BY_WIDTH = {1: torch.uint8, 2: torch.int16}


def encode(routing_RLK: torch.Tensor | None) -> tuple[bytes | None, list[int] | None]:
    if routing_RLK is None:
        return None, None
    return routing_RLK.contiguous().numpy().tobytes(), list(routing_RLK.shape)


def decode(data: bytes | None, shape: list[int] | None) -> torch.Tensor | None:
    if data is None or shape is None:
        return None
    count = shape[0] * shape[1] * shape[2]
    if count == 0:
        return torch.zeros(shape, dtype=torch.uint8)
    dtype = _BY_WIDTH[len(data) // count]
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
