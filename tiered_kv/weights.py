"""The weights as they act now: a digest that names them, computed once per model and kept until its
weights or adapters change (identity.py puts it in every block key).

The weight digest reads every tensor's name, shape and dtype and a strided sample of its values (at
most `SAMPLED_VALUES_PER_TENSOR` per tensor): two fine-tunes, or a base and an instruct model, differ
in every sampled tensor. A change to a handful of single weights could slip past a sample; pass
`model_id=` (e.g. a checkpoint hash) when that matters, or when hashing weights is too slow. The
adapters (peft) that act count too (adapters.py): each one's name, config, settings (scaling, rank,
...) and weights, and in which layers it acts; a loaded but inactive or disabled adapter does not.

Digested once per model, kept until its weights or adapters change: a `WeightsTracker` per model
(weakly keyed) keeps the digests and a version token: every tensor (the same object, held
weakly), its data_ptr and its `_version` counter (a new tensor, a new storage, or an in-place
write through the tensor itself: load_state_dict, an optimizer step) plus the tuner layers' flags
(active / disabled / merged adapters, scalings: set_adapter, disable_adapter(), merge_adapter(),
whose in-place `.data` writes bump no version). Building a bank, attaching, and a prefill compare
the whole token (O(modules + tensors) host reads, no device work); a decode step compares the
flags of one tuner layer (O(1)). Only a changed part is digested again: the base weights (after
any merge or unmerge too), or one adapter. Not seen: an in-place write through `param.data`
without a flag change, or a merge_adapter() undone by unmerge_adapter() with no bank built,
attached or stepped in between (the base weights come back rounded); call `forget(model)` after
one. Adapters it cannot identify (adapters.py) keep the model's blocks private (`Weights.weights_id`
is None), with a warning logged once.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref

from .adapters import AdapterScan, all_tensors, runtime_model
from .logs import log_once

KEY_BYTES = 16  # every digest here and in identity.py: BLAKE2b of 16 bytes
SAMPLED_VALUES_PER_TENSOR = 4096
log = logging.getLogger(__name__)


def _digest_tensors(digest, named_tensors) -> None:
    """Names, shapes, dtypes and a strided sample of each tensor's values into `digest`."""
    import torch

    with torch.no_grad():
        for name, tensor in named_tensors:
            digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
            flat = tensor.detach().reshape(-1)
            if flat.numel() == 0:
                continue
            stride = max(1, flat.numel() // SAMPLED_VALUES_PER_TENSOR)
            sample = flat[::stride][:SAMPLED_VALUES_PER_TENSOR].to("cpu", copy=True).contiguous()
            digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.dtype == torch.bfloat16
                          else sample.numpy().tobytes())


def weights_digest(model, named_tensors=None) -> bytes:
    """A digest of `named_tensors` (default: the model's parameters and buffers): names, shapes,
    dtypes and a strided sample. Copies a sample of every tensor to the host: once per model
    and change (WeightsTracker), never per bank or per step."""
    if named_tensors is None:
        named_tensors = list(model.named_parameters()) + list(model.named_buffers())
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    _digest_tensors(digest, named_tensors)
    return digest.digest()


def adapter_digest(name: str, config_text: str, settings: list[str], named_tensors) -> bytes:
    """One adapter: its name, peft config, per-layer settings (scaling, rank, dropout, ...) and a
    sample of its weights."""
    digest = hashlib.blake2b(f"tiered_kv/adapter|{name}|{config_text}|".encode(), digest_size=KEY_BYTES)
    digest.update("\n".join(settings).encode())
    _digest_tensors(digest, named_tensors)
    return digest.digest()


class Weights:
    """The weights as they act now, as a tracker saw them. `weights_id` names them for sharing
    (None: they cannot be identified, blocks stay private); `identity` tells two states apart
    even then (equal identities: equal KV)."""

    __slots__ = ("weights_id", "identity", "problem")

    def __init__(self, weights_id: bytes | None, identity: bytes, problem: str | None = None):
        self.weights_id = weights_id
        self.identity = identity
        self.problem = problem


class _Versions:
    """Whether a list of tensors is the same tensors, unwritten, as when recorded: each tensor's
    object (weakly held: a freed tensor's id or storage may be reused), storage and version counter."""

    __slots__ = ("_refs", "_token")

    def __init__(self, tensors, token):
        self._refs = [weakref.ref(t) for t in tensors]
        self._token = token

    @staticmethod
    def token(tensors) -> list[tuple[int, int]]:
        token = []
        for tensor in tensors:
            try:
                version = tensor._version
            except RuntimeError:  # an inference tensor has no version counter
                version = -1
            token.append((tensor.data_ptr(), version))
        return token

    def matches(self, tensors, token) -> bool:
        return token == self._token and len(tensors) == len(self._refs) and \
            all(ref() is tensor for ref, tensor in zip(self._refs, tensors))


_private_ids = iter(range(1, 1 << 62))


class WeightsTracker:
    """The `Weights` of one model, digested once and kept until its tensors or adapters change.

    `check(full=True)` compares the version token (every tensor and tuner flag: O(tensors) host
    reads, no device work) and digests only what changed; `check(full=False)` (a decode step)
    compares only the O(1) adapter flags of one tuner layer. Thread-safe."""

    def __init__(self, model, model_id: str | None = None):
        self._model = weakref.ref(model)
        self._runtime = weakref.ref(runtime_model(model))
        self._model_id_key = None if model_id is None else \
            hashlib.blake2b(b"model_id|" + model_id.encode(), digest_size=KEY_BYTES).digest()
        self._lock = threading.Lock()
        self.forget()

    def forget(self) -> None:
        """Digest everything again at the next check (after an in-place write through `.data`)."""
        self._versions: _Versions | None = None  # every tensor, at the last full check
        self._state = None  # the tuner layers' flags then
        self._scan: AdapterScan | None = None
        self._quick = None
        self._weights: Weights | None = None
        self._base = None  # (base tensors' _Versions, merged flags, digest)
        self._adapters: dict[str, tuple] = {}  # name -> (its tensors' _Versions, settings text, digest)

    def check(self, full: bool = True) -> Weights:
        weights, scan = self._weights, self._scan
        if not full and weights is not None and scan is not None and scan.quick_token() == self._quick:
            return weights
        with self._lock:
            return self._check_all()

    def _check_all(self) -> Weights:
        model, runtime = self._model(), self._runtime()
        if model is None or runtime is None:  # no bank can run it any more
            return self._weights or Weights(None, b"private|gone")
        tensors = all_tensors(model, runtime)
        token = _Versions.token(tensors)
        same_tensors = self._versions is not None and self._versions.matches(tensors, token)
        scan = self._scan if same_tensors and self._scan is not None else AdapterScan(model, runtime)
        state = scan.state_token()
        if same_tensors and state == self._state and self._weights is not None:
            return self._weights
        weights = self._compute(runtime, scan)
        self._versions = self._versions if same_tensors else _Versions(tensors, token)
        self._scan, self._state, self._quick, self._weights = scan, state, scan.quick_token(), weights
        return weights

    def _compute(self, runtime, scan: AdapterScan) -> Weights:
        per_layer, unmerging, problem = scan.acting() if scan.has_adapters else ({}, [], None)
        if problem is not None:
            log_once(log, logging.WARNING, "tiered_kv: cannot identify the adapters acting on this model (%s): the KV "
                     "of its banks stays private (never published, never reused across chats)", problem)
            return Weights(None, b"private|%d" % next(_private_ids), problem)
        base_id = self._base_id(runtime, scan)
        prompt = scan.prompt_adapter() if scan.wrapper is not None else None
        names = list(dict.fromkeys([n for acting in per_layer.values() for n in acting] + ([prompt] if prompt else [])))
        if not names and not unmerging:  # the base weights alone act (no adapter, or all disabled)
            return Weights(base_id, base_id)
        digest = hashlib.blake2b(b"tiered_kv/adapters-v1|" + base_id, digest_size=KEY_BYTES)
        for name in names:
            digest.update(f"|adapter={name}|".encode() + self._adapter_id(scan, name))
        for path, acting in per_layer.items():
            digest.update(f"|{path}={','.join(acting)}".encode())
        for path in unmerging:
            digest.update(f"|unmerges:{path}".encode())
        digest.update(f"|prompt={prompt}".encode())
        weights_id = digest.digest()
        return Weights(weights_id, weights_id)

    def _base_id(self, runtime, scan: AdapterScan) -> bytes:
        """The base weights' id: the user's model_id, else their digest (kept while the same base
        tensors, unwritten, and the same merged adapters)."""
        if self._model_id_key is not None:
            return self._model_id_key
        named = scan.base_named()
        tensors = [t for _, t in named]
        token = _Versions.token(tensors)
        merged = tuple((layer.path, tuple(getattr(layer.module, "merged_adapters", ()))) for layer in scan.layers)
        cached = self._base
        if cached is not None and cached[1] == merged and cached[0].matches(tensors, token):
            return cached[2]
        # any merge or unmerge since: digest again (an unmerge leaves the weights rounded, not as before)
        digest = weights_digest(runtime, named)
        self._base = (_Versions(tensors, token), merged, digest)
        return digest

    def _adapter_id(self, scan: AdapterScan, name: str) -> bytes:
        named = scan.tensors_of(name)
        tensors = [t for _, t in named]
        token = _Versions.token(tensors)
        settings = scan.settings_of(name)
        config_text = scan.config_text(name)
        cached = self._adapters.get(name)
        if cached is not None and cached[1] == (settings, config_text) and cached[0].matches(tensors, token):
            return cached[2]
        digest = adapter_digest(name, config_text, settings, named)
        self._adapters[name] = (_Versions(tensors, token), (settings, config_text), digest)
        return digest


_trackers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {model_id: WeightsTracker}
_trackers_lock = threading.Lock()


def tracker_of(model, model_id: str | None = None) -> WeightsTracker:
    """The one tracker of `model` (and `model_id`), kept as long as the model lives."""
    with _trackers_lock:
        per_model = _trackers.get(model)
        if per_model is None:
            per_model = _trackers[model] = {}
        tracker = per_model.get(model_id)
        if tracker is None:
            tracker = per_model[model_id] = WeightsTracker(model, model_id)
        return tracker


def forget(model) -> None:
    """Digest `model`'s weights again at the next check: after writing them in place through
    `param.data` (which bumps no version counter) outside peft's merge / unmerge."""
    with _trackers_lock:
        trackers = list(_trackers.get(model, {}).values())
    for tracker in trackers:
        with tracker._lock:
            tracker.forget()
