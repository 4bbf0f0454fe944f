"""The layers of a model of several layer groups, or of sliding-window layers (layer_groups.py).

Each layer's rows are its group's; what it reads back is what DynamicLayer and
DynamicSlidingWindowLayer return: a full layer every token, a sliding layer its window's last
`window - 1` tokens and the new ones. They read and write through the lease's token runs (a
sliding row's window moves every step, which a prepared slab index would not follow), and
attention (transformers' own, or the hooks' sdpa) gets these K/V with transformers' masks
(sliding ones sized by CacheBank.get_mask_sizes).
"""

from __future__ import annotations

import torch


def grouped_layer(steps, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
    """update() of one layer of a grouped model, through the step's lease."""
    step, groups, seq = steps.step, steps.seq.layer_groups, steps.seq
    kv_new = torch.stack((key_states, value_states))  # [2, B, H, t, D]
    lease = step.lease
    g, local = groups.group_of_layer[layer_idx], groups.local_of_layer[layer_idx]
    group, num_groups = groups.groups[g], seq.num_groups
    visible = group.kept_tokens(seq.num_tokens) + step.num_new_tokens
    # a group short of a block's layers (the last of its kind, above MAX_GROUPS) writes zeros
    # there, so every layer of its blocks is written (a cold record is durable only then)
    padding = range(len(group.layers), groups.layers_per_group) if local == len(group.layers) - 1 else ()
    with steps.rolled_back_on_error():
        rows = []
        for r in range(kv_new.shape[1]):
            store_row = r * num_groups + g
            lease.write_layer(local, store_row, kv_new[:, r])
            for pad in padding:
                lease.write_layer(pad, store_row, torch.zeros_like(kv_new[:, r]))
            kv = lease.read_layer(local, store_row)
            if lease.rows[store_row].skipped_new_tokens:  # gapped: its old tokens, then the new ones
                kv = torch.cat((kv, kv_new[:, r]), dim=2)
            rows.append(kv if kv.shape[2] == visible else kv[:, :, -visible:])
    kv = rows[0].unsqueeze(1) if len(rows) == 1 else torch.stack(rows, dim=1)
    if layer_idx == groups.num_layers - 1:
        if not step.forward_seen:
            kv = kv.clone()  # (committed now: nobody says when attention is done with its views)
        steps.layers_done()
    return kv[0], kv[1]


__all__ = ["grouped_layer"]
