"""Token ids as a tensor, the one conversion a call's prompt and every proposer's history go through."""
from __future__ import annotations

from typing import Sequence as Seq

import numpy as np
import torch


def token_tensor(tokens: Seq[int], device) -> torch.Tensor:
    """Token ids (a list of ints, an array, or a tensor) -> [len(tokens)] int64 on ``device``,
    through numpy: several times faster than ``torch.tensor`` of a list, which a call would
    otherwise pay for its prompt in the prefill and in the proposer's history. A tensor on
    ``device`` already is returned as it is (no copy, no wait)."""
    if torch.is_tensor(tokens):
        return tokens.to(device=device, dtype=torch.long).reshape(-1)
    ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64).reshape(-1))
    if torch.device(device).type == "cuda":  # (from pinned memory: queued behind the device's work, no wait for it)
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)
