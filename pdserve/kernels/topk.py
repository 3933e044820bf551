"""Row-wise argmax and top-k over a large vocabulary, via per-block maxima.

torch's CPU ``argmax``/``topk`` along a 32k-wide row are scalar loops (~1 ns per element;
``argmax`` of 8 x 32000 float32 logits measured 270 us on the 2-core EPYC), while ``amax`` over
a short contiguous last dim is vectorised (~20 us for the same tensor). So: split each row into
blocks, take every block's max (one vectorised pass), pick the winning block(s) from the few
hundred maxima, and search only inside them.

Both are exact. ``argmax_rows`` returns the first index of the maximum, as ``argmax`` does: the
first block holding the row max, then the first index inside it. ``topk_rows`` returns the
exact top-k values: an element of the top k lies in a block whose max is among the k largest
block maxima (otherwise k larger elements would exist); among ties, ids may differ from
``topk``'s.
"""

from __future__ import annotations

import torch

ARGMAX_BLOCK = 128
TOPK_BLOCK = 64


def argmax_rows(x: torch.Tensor, block: int = ARGMAX_BLOCK) -> torch.Tensor:
    """``x.argmax(dim=1)`` for a 2-D tensor ``(B, V)``, int64 ``(B,)``."""
    num_rows, width = x.shape
    num_blocks = width // block
    if num_blocks < 2:
        return x.argmax(dim=1)
    main = x[:, : num_blocks * block].unflatten(1, (num_blocks, block))
    best_block = main.amax(dim=2).argmax(dim=1)  # first block holding the max of `main`
    inside = main[torch.arange(num_rows, device=x.device), best_block].argmax(dim=1)
    ids = best_block * block + inside
    if width % block:
        # The ragged tail wins only when strictly larger (an earlier tie keeps the first id).
        tail = x[:, num_blocks * block :]
        tail_max, tail_arg = tail.max(dim=1)
        is_tail = tail_max > x.gather(1, ids.unsqueeze(1)).squeeze(1)
        ids = torch.where(is_tail, tail_arg + num_blocks * block, ids)
    return ids


def topk_rows(
    x: torch.Tensor, k: int, block: int = TOPK_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values of each row of ``x`` ``(B, V)``, descending, and their ids."""
    num_rows, width = x.shape
    num_blocks = width // block
    if width % block or k * block * 2 > width:
        return x.topk(k, dim=1)  # ragged rows, or the blocks would cover most of the row anyway
    blocks = x.unflatten(1, (num_blocks, block))
    top_blocks = blocks.amax(dim=2).topk(k, dim=1, sorted=False).indices  # (B, k)
    gathered = blocks.gather(1, top_blocks.unsqueeze(2).expand(num_rows, k, block))
    values, where = gathered.flatten(1).topk(k, dim=1)
    ids = top_blocks.gather(1, where // block) * block + where % block
    return values, ids
