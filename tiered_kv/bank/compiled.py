"""Decoding under torch.compile: each step prepared outside the graph, settled after it.

transformers compiles the model's `__call__` for decode steps when the cache `is_compileable`
(`generate(..., compile_config=...)`; on a GPU whenever it can). Nothing a graph cannot hold may
run inside that call: no lock, no store call, no numpy, no Python per block, no graph break. So:

- before the call, generate builds the step's mask outside the graph and asks the bank
  `get_mask_sizes`; there (eagerly) the bank settles the step before (`settle`) and prepares
  this one (`prepare_decode`): its lease (O(rows) while its token lands in its tail block:
  opening.open_decode; a new block every block_size tokens), its plan (plan.py) and device
  buffers for the step's token ids;
- inside the graph only tensor ops run: the forward pre-hook copies the step's ids into those
  buffers (`note_inputs`), each layer writes its K/V and reads the step's blocks (the traced
  layers of plan.py, over the one slab tensor), and the last layer marks the step done (an
  attribute that Dynamo sets once the graph ran);
- after the call, at the bank's next eager call (the next step's mask, or any public method),
  the step commits, or rolls back when the graph did not finish; its ids are read once their
  copy landed (no host sync) and its full verified blocks are published.

A step's blocks stay pinned from its preparation until it settles: the last step of a generate()
holds its chat's blocks until the bank is used next. A graph reads only blocks on the device slab
(hot, and on a CPU store paged warm); a step whose blocks lie elsewhere (cold, compressed warm, a
GPU's warm) runs its forward eagerly instead (`torch.compiler.set_stance("force_eager")` for that
one call, said once), never through a graph break.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from ..logs import log_once
from ..store.device_slab import is_run
from .step import DeferredInputs, RowInputs

log = logging.getLogger(__name__)


class CompiledStepError(RuntimeError):
    """A compiled decode step found no step prepared for it, or blocks it cannot read in a graph."""


def can_compile(bank) -> bool:
    """Whether generate() may compile decode steps with this bank: a bank built from a model (it
    sees the model's forwards) of one full-attention group (a sliding window's steps change which
    blocks a layer reads in ways a graph does not follow)."""
    return bank.layer_groups.is_single_full and bank.model_ref is not None


def answer_is_compileable(bank, caller) -> bool:
    """`cache.is_compileable` as each of transformers' callers (`caller`, the asking frame) means it:
    - generate's `_valid_auto_compile_criteria`: may this generate compile? Only when it was given
      a `compile_config` (transformers would otherwise compile every CUDA generate with a
      compileable cache: the bank opts in, it does not impose), on a device it compiles on; the
      bank notes the answer;
    - `prepare_inputs_for_generation`, every step: shall generate build the step's mask outside the
      model? Only in a generate that compiles: that is where the bank prepares each step;
    - the mask functions inside an eager forward: False, so masks (and so the logits) are those of
      a DynamicCache, bit for bit; inside a graph `is_compiling()` answers before this is asked;
    - anyone else (user code): whether the bank can be compiled at all."""
    if not can_compile(bank):
        return False
    name = caller.f_code.co_name
    if name == "_valid_auto_compile_criteria":
        bank.steps.generate_compiles = _generate_compiles(caller.f_locals)
        return bank.steps.generate_compiles
    if name == "prepare_inputs_for_generation":
        return bank.steps.generate_compiles
    return caller.f_globals.get("__name__") != "transformers.masking_utils"


def _generate_compiles(local_vars: dict) -> bool:
    """Whether the generate() whose `_valid_auto_compile_criteria` asks will compile: it was given a
    compile config, does not disable compiling, and runs on a device transformers compiles on
    (every device when the compile config says `_compile_all_devices`)."""
    config, model = local_vars.get("generation_config"), local_vars.get("self")
    if config is None or model is None or getattr(config, "disable_compile", False):
        return False
    compile_config = getattr(config, "compile_config", None)
    if compile_config is None:
        return False
    return getattr(getattr(model, "device", None), "type", "cpu") in ("cuda", "xpu", "neuron", "tpu", "mps") or \
        bool(getattr(compile_config, "_compile_all_devices", False))


def expected(steps) -> bool:
    """Whether the model's next decode forward may be compiled (a generate() that compiles runs)."""
    return steps.generate_compiles and steps.seq.layer_groups.is_single_full


def prepare_decode(steps, num_new_tokens: int) -> None:
    """Outside the graph, before a compiled decode forward: settle the step before, then open this
    one (lease, plan, id buffers), so the forward only runs tensor ops on it."""
    step, seq = steps.step, steps.seq
    if step is not None and step.compiled and not step.layers_done and step.num_new_tokens == num_new_tokens:
        return  # prepared already (generate asks the query offset, then the mask sizes, for one step)
    settle(steps)
    if steps.step is not None or not seq.rows or not steps.store.is_bound:
        return
    steps.begin(seq.batch_size, num_new_tokens, None, compiled=True)
    if steps.plan is not None and steps.plan.read_kind not in ("view", "gather") and _fits_device_slab(steps):
        steps.rollback()  # its blocks are where no graph reads them, but would fit where one does
        steps.bank.promote_rows(seq.rows)
        steps.begin(seq.batch_size, num_new_tokens, None, compiled=True)
    step = steps.step
    if step is None or steps.plan is None:
        return
    if steps.plan.read_kind not in ("view", "gather"):  # (a graph cannot read it: this forward runs eagerly)
        log_once(log, logging.WARNING, "tiered_kv: a compiled decode step reads blocks the device does not hold in "
                 "place (cold, compressed or a GPU's warm): it runs eagerly (raise hot.capacity to keep the chat "
                 "on the device slab)")
        steps.forced_eager = True
        torch.compiler.set_stance("force_eager")
        return
    device, before = steps.store.device, seq.num_tokens
    step.ids_buffer = torch.zeros((step.num_rows, num_new_tokens), dtype=torch.long, device=device)
    step.ok_buffer = torch.zeros(step.num_rows, dtype=torch.bool, device=device)
    step.expected_positions = torch.arange(before, before + num_new_tokens, device=device)


def _fits_device_slab(steps) -> bool:
    """Whether the chat's blocks (and one more per row) fit the tiers the device slab holds."""
    store = steps.store
    slab = store.device_slab
    capacity = sum(n for tier, n in enumerate(store.capacities) if tier < len(slab.first_slot) - 1
                   and slab.first_slot[tier] >= 0)
    return sum(len(row.table) + 1 for row in steps.seq.rows) <= capacity


def note_inputs(steps, input_ids, position_ids) -> None:
    """Inside the graph (the forward pre-hook): the step's token ids, and whether their positions
    continue the bank's tokens, into the step's buffers."""
    step = steps.step
    if step is None or not step.compiled or input_ids is None or input_ids.shape != step.ids_buffer.shape:
        return
    step.ids_buffer.copy_(input_ids)
    if position_ids is None:
        step.ok_buffer.fill_(True)
    elif position_ids.shape[-1] == step.num_new_tokens:
        step.ok_buffer.copy_((position_ids == step.expected_positions).all(dim=-1).expand(step.num_rows))


def end_forced_eager(steps) -> None:
    """At the bank's next eager call after a forward prepare_decode made eager (outside any forward:
    torch checks the stance as the compiled call returns): compiled calls compile again."""
    if steps.forced_eager:
        steps.forced_eager = False
        torch.compiler.set_stance("default")


def settle(steps) -> None:
    """At the bank's next eager call: commit the compiled step that ran (its ids read once their
    copy landed), or roll back one whose graph did not finish."""
    end_forced_eager(steps)
    step = steps.step
    if step is None or not step.compiled:
        return
    if not step.layers_done:
        steps.rollback()
        return
    ids, ok = step.ids_buffer, step.ok_buffer
    if ids.is_cuda:
        step.inputs = DeferredInputs.copy(ids, ok)
    else:
        step.inputs = [RowInputs(row, bool(v)) for row, v in zip(ids.tolist(), ok.tolist())]
    steps.commit()


def check_traced(steps):
    """The plan of the compiled step a traced layer 0 runs (raised in the graph when none)."""
    plan = steps.plan
    if plan is None or not steps.step.compiled:
        raise CompiledStepError("a compiled forward found no decode step prepared for it: the bank prepares one when "
                                "generate() builds the step's mask (get_mask_sizes); call the compiled model through "
                                "generate(), or run it eagerly")
    return plan


# ---- the layers a compiled step traces: one slab tensor in, no prepared views ------------------------
def prepare_traced(plan, slab, blocks: list[np.ndarray], num_tokens: int, device, allow_views: bool) -> None:
    """plan.prepare's `traced`: layers that slice or gather `slab.whole` inside the graph (views
    made outside it would be inputs aliasing one another, which the compiler copies)."""
    if plan.write_kind not in ("index", "put"):
        return  # (its new tokens' block is not on the slab: staged, which no graph can run)
    plan.whole, plan.block_size, plan.num_rows, plan.num_tokens = slab.whole, slab.block_size, len(blocks), num_tokens
    if len(blocks) == 1 and allow_views and is_run(blocks[0]):
        plan.read_first = int(blocks[0][0]) * slab.block_size
        plan.read_kind, plan.layer = "view", functools.partial(_view_layer, plan)
        return
    heads = slab.layers_k[0].shape[0]
    if len(blocks) == 1:
        plan.gather_index = torch.from_numpy(blocks[0]).to(device, non_blocking=True)
    else:
        plan.gather_index = (torch.arange(2, device=device).view(2, 1, 1, 1),
                             torch.arange(heads, device=device).view(1, 1, heads, 1),
                             torch.from_numpy(np.stack(blocks)).to(device, non_blocking=True).view(1, len(blocks), 1, -1))
    plan.read_kind, plan.layer = "gather", functools.partial(_gather_layer, plan)


def _write(plan, kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if plan.write_kind == "put":
        kv[0].index_put_(plan.write_index, key)
        kv[1].index_put_(plan.write_index, value)
    else:
        kv[0].index_copy_(1, plan.write_index, key[0])
        kv[1].index_copy_(1, plan.write_index, value[0])


def _view_layer(plan, layer: int, key: torch.Tensor, value: torch.Tensor, seam):
    kv = plan.whole[layer]  # [2, H, S, D]
    _write(plan, kv, key, value)
    if layer == plan.last_layer:
        plan.on_last_layer()
    first, end = plan.read_first, plan.read_first + plan.num_tokens
    return kv[0, :, first:end].unsqueeze(0), kv[1, :, first:end].unsqueeze(0)


def _gather_layer(plan, layer: int, key: torch.Tensor, value: torch.Tensor, seam):
    kv = plan.whole[layer]  # [2, H, S, D]
    _write(plan, kv, key, value)
    heads, slots, dim = kv.shape[1], kv.shape[2] // plan.block_size, kv.shape[3]
    blocks = kv.view(2, heads, slots, plan.block_size * dim)
    if plan.num_rows == 1:
        gathered = blocks.index_select(2, plan.gather_index).unsqueeze(1)  # [2, 1, H, n_blocks, bs * D]
    else:
        gathered = blocks[plan.gather_index]  # [2, B, H, n_blocks, bs * D]
    tokens = gathered.reshape(2, plan.num_rows, heads, -1, dim)[:, :, :, :plan.num_tokens]
    if layer == plan.last_layer:
        plan.on_last_layer()
    return tokens[0], tokens[1]


__all__ = ["can_compile", "answer_is_compileable", "expected", "prepare_decode", "note_inputs", "settle", "end_forced_eager", "check_traced", "prepare_traced",
           "CompiledStepError"]
