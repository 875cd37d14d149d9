"""The target features of every position a step committed, per request.

Drafters catch up from them (``spec``) and capture keeps them for training (``capture``):
one extraction serves both. A feature is the target's final-norm hidden state, or the
concatenation of chosen layers' residual streams for a fused drafter (``feature_layers``).
"""

from __future__ import annotations

import torch

from tlt_serve.engine.request import Request
from tlt_serve.engine.runner import RunOutput
from tlt_serve.engine.scheduler import Emitted, Sampled, ScheduledBatch

Committed = list[tuple[Request, torch.Tensor]]  # (request, features [m, F]) per sampler


def committed_features(
    batch: ScheduledBatch, run: RunOutput, emitted: Sampled | Emitted, layers: tuple[int, ...],
    store: torch.Tensor | None = None,
) -> Committed:
    """Each sampler's features of the positions this step fed through the target and kept:
    the prompt (prefill), the last token (plain decode), the last token plus the accepted
    drafts (chain verify) or the accepted tree path. Copies, safe to keep.

    With ``store`` (``KVCache.features`` [rows, max_len, F]) they are written at their
    positions in each sampler's row, and a prompt whose prefix came from the prefix cache
    (computed from ``cached_tokens`` on) gets that prefix's features from there."""
    feats = torch.cat(run.aux, dim=-1) if layers else run.hidden  # [F, Q, F']
    out: Committed = []
    for i, req in enumerate(batch.samplers):
        if i >= batch.decodes:  # admitted: its prompt
            m = len(req.prompt_ids)
            lead = batch.logit_index[i]  # siblings read their leader's row
            c = batch.forward[lead].cached_tokens  # columns [c, m) computed now
            f = feats[lead, : m - c]  # [m - c, F]
            if store is not None:
                store[req.row, c:m] = f
                f = store[req.row, :m]  # [m, F]
            else:
                assert c == 0, "a cached prefix's features are kept in the store only"
        else:
            if isinstance(emitted, Emitted) and emitted.path is not None:  # tree: the path
                f = feats[i, emitted.path[i]]  # [m, F] (advanced indexing copies)
            else:
                m = len(emitted.token_ids[i]) if isinstance(emitted, Emitted) else 1
                f = feats[i, :m]  # [m, F]
            if store is not None:  # from the last token's position on
                p = req.num_tokens - 1
                store[req.row, p : p + f.shape[0]] = f
        out.append((req, f.clone()))
    return out
