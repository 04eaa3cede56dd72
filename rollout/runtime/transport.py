"""Moving small control data between ranks without pickle.

torch.distributed's *_object collectives pickle their payload; a worker must never unpickle bytes
from another process. Control data (cursors, flags) is small and JSON-able, so it travels as UTF-8
JSON in uint8 tensors instead.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def all_gather_json(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (JSON-able values only)."""
    payload = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.long))
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    buffers = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(buffers, padded)
    return [
        json.loads(bytes(buffer[: int(size.item())].tolist()).decode())
        for buffer, size in zip(buffers, sizes, strict=True)
    ]
