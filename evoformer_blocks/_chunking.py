"""Running a row-wise function on a bounded number of rows at a time (``chunk_size``)."""

from __future__ import annotations

from typing import Callable, Optional

import torch


def chunked(fn: Callable[..., torch.Tensor], inputs: dict, no_batch_dims: int, chunk_size: Optional[int]):
    """Runs ``fn(**inputs)`` on at most ``chunk_size`` rows at a time and concatenates the results.

    The first ``no_batch_dims`` dims of every input (broadcast to one shape) are flattened into rows;
    ``fn`` must treat rows independently. The output keeps the inputs' leading dims.
    """
    lead = torch.broadcast_shapes(*(t.shape[:no_batch_dims] for t in inputs.values()))
    rows = 1
    for size in lead:
        rows *= size
    if chunk_size is None or chunk_size >= rows:
        return fn(**inputs)
    flat = {
        k: t.expand(*lead, *t.shape[no_batch_dims:]).reshape(rows, *t.shape[no_batch_dims:])  # [rows, ...]
        for k, t in inputs.items()
    }
    parts = [
        fn(**{k: t[start : start + chunk_size] for k, t in flat.items()}) for start in range(0, rows, chunk_size)
    ]
    out = torch.cat(parts, dim=0)  # [rows, ...]
    return out.reshape(*lead, *out.shape[1:])  # [*lead, ...]
