"""What adapters (peft) act on a model, found without importing peft.

peft injects its tuners into a transformers model in place: every adapter's weights stay in the
model's parameters whichever is active (DESIGN.md, "Facts about the dependencies"), and which
one acts is a flag on each tuner layer (`set_adapter`, `disable_adapter()`, `merge_adapter()`).
A block's KV depends on the adapters that act, so identity.py names them in every key. This
module reads them off the model:

- `runtime_model(model)`: the module whose forward actually runs. A `PeftModel` wrapper's
  `generate` calls its inner transformers model's, so a bank watches (and hooks patch) that one.
- `all_tensors(model, runtime)`: every parameter and buffer, in one walk (a version token's input).
- `AdapterScan(model, runtime)`: the tuner layers of the runtime model (each a `TunerLayer`:
  tuner_layers.py) and, for a PeftModel, its prompt-learning adapter; `base_named()` the base
  weights by name; `state_token()` what must stay equal for the acting weights to stay the same
  (active / disabled / merged flags and LoRA scalings: O(tuner layers) host reads), `quick_token()`
  the O(1) part of it a decode step checks (the flags of one layer: peft sets them on every layer at
  once); `acting()` says which adapter acts in which layer, `tensors_of(name)` and
  `settings_of(name)` what an adapter's digest covers.

Known tuners are those whose whole adapter state is in `adapter_layer_names` /
`other_param_names` / per-adapter dicts of the layer: LoRA (and its variants: DoRA, rsLoRA,
quantized bases), AdaLoRA, IA3, LoHa, LoKr, `modules_to_save` copies, and the prompt-learning
adapters of a PeftModel (prompt tuning, p-tuning, prefix tuning: their virtual tokens' weights
are the prompt encoder). Anything else is reported in `problem`: its blocks must stay private.
"""

from __future__ import annotations

import weakref

import torch

from .tuner_layers import TunerLayer, as_names

# tuner layer classes defined in these peft modules keep all of an adapter's state where the scan looks
KNOWN_TUNER_MODULES = ("peft.tuners.lora.", "peft.tuners.adalora.", "peft.tuners.ia3.", "peft.tuners.loha.",
                       "peft.tuners.lokr.")
KNOWN_PEFT_TYPES = frozenset({"LORA", "ADALORA", "IA3", "LOHA", "LOKR"})
PROMPT_LEARNING_TYPES = frozenset({"PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING"})
# names in a parameter's path that a tuner adds around the base weight (stripped, so a plain
# model and the same weights under a disabled adapter name their tensors alike)
WRAPPER_SEGMENTS = frozenset({"base_layer", "original_module"})


def is_peft_wrapper(model) -> bool:
    """A peft `PeftModel` / `PeftMixedModel` (not the transformers model it wraps)."""
    return type(model).__module__.startswith("peft.") and callable(getattr(type(model), "get_base_model", None))


def runtime_model(model):
    """The module whose forward runs when `model` generates: a PeftModel's inner transformers
    model, else `model` itself."""
    if is_peft_wrapper(model):
        inner = model.get_base_model()
        if isinstance(inner, torch.nn.Module):
            return inner
    return model


def normalized_name(name: str) -> str:
    """`name` without the path segments a tuner adds around a base module."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def _class_names(module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def _peft_type(config) -> str:
    peft_type = getattr(config, "peft_type", None)
    return str(getattr(peft_type, "value", peft_type))


def all_tensors(model, runtime) -> list[torch.Tensor]:
    """Every parameter and buffer of `runtime` (and a peft wrapper's prompt encoders), each once,
    in a fixed order: one walk over the module tree without building names (a version token's
    input at every full check)."""
    seen_modules, seen_tensors, tensors = set(), set(), []
    roots = [runtime]
    encoders = getattr(model, "prompt_encoder", None) if model is not runtime else None
    if isinstance(encoders, torch.nn.Module):
        roots.append(encoders)
    stack = roots[::-1]
    while stack:
        module = stack.pop()
        if id(module) in seen_modules:
            continue
        seen_modules.add(id(module))
        for group in (module._parameters, module._buffers):
            for tensor in group.values():
                if tensor is not None and id(tensor) not in seen_tensors:
                    seen_tensors.add(id(tensor))
                    tensors.append(tensor)
        children = [child for child in module._modules.values() if child is not None]
        stack.extend(reversed(children))
    return tensors


class AdapterScan:
    """The adapters of one model: its tuner layers, its prompt-learning adapter, and the first
    reason they cannot be identified (`problem`), if any. Built again whenever the model's set of
    tensors changes (a tuner layer or an adapter added or removed), so what depends only on the
    layers and tensors is computed once per scan: the named base tensors, each adapter's tensors
    and settings."""

    def __init__(self, model, runtime):
        # weakly: a tracker keeps its scan, and the tracker must not keep its model alive
        self._wrapper = weakref.ref(model) if is_peft_wrapper(model) else None
        self._runtime = weakref.ref(runtime)
        self._owned: set[int] | None = None
        self.layers: list[TunerLayer] = []
        self.problem: str | None = None
        self._tensors_of: dict[str, list] = {}
        self._settings_of: dict[str, list[str]] = {}
        self._base_named: list | None = None
        for path, module in runtime.named_modules():
            classes = _class_names(module)
            if "BaseTunerLayer" in classes:
                known = type(module).__module__.startswith(KNOWN_TUNER_MODULES)
                self.layers.append(TunerLayer(path, module, is_wrapper=False))
            elif "AuxiliaryTrainingWrapper" in classes:
                known = type(module).__name__ == "ModulesToSaveWrapper" and type(module).__module__.startswith("peft.")
                self.layers.append(TunerLayer(path, module, is_wrapper=True))
            else:
                continue
            if not known and self.problem is None:
                self.problem = (f"unknown peft tuner layer type {type(module).__module__}.{type(module).__qualname__} "
                                f"at {path!r}")
        self.configs = getattr(model, "peft_config", None) or getattr(runtime, "peft_config", None)
        if not isinstance(self.configs, dict):
            self.configs = {}
        # a decode step's sample: the first tuner layer and the first modules_to_save wrapper (peft sets
        # flags on every layer of a kind at once; a wrapper has no merged adapters)
        self._sampled = [layer for layer in (next((l for l in self.layers if not l.is_wrapper), None),
                                             next((l for l in self.layers if l.is_wrapper), None)) if layer]

    @property
    def wrapper(self):
        """The peft wrapper (PeftModel) the bank was given, or None."""
        return self._wrapper() if self._wrapper is not None else None

    def base_named(self) -> list[tuple[str, torch.Tensor]]:
        """The base weights (every tensor no adapter owns) by name, names as a plain model has them."""
        if self._base_named is None:
            runtime = self._runtime()
            if runtime is None:
                return []
            named = list(runtime.named_parameters()) + list(runtime.named_buffers())
            if self.has_adapters:
                owned = self.owned_tensor_ids()
                named = [(normalized_name(n), t) for n, t in named if id(t) not in owned]
            self._base_named = named
        return self._base_named

    @property
    def has_adapters(self) -> bool:
        return bool(self.layers) or self._wrapper is not None

    # ---- what must stay equal ----------------------------------------------------------------
    def _wrapper_state(self) -> tuple | None:
        wrapper = self.wrapper
        if wrapper is None:
            return None
        return as_names(getattr(wrapper, "active_adapter", None)), bool(getattr(wrapper, "_adapters_disabled", False))

    def state_token(self) -> tuple:
        """O(tuner layers) host reads; equal tokens (and equal tensor versions) mean equal acting weights."""
        return self._wrapper_state(), tuple(layer.state() for layer in self.layers)

    def quick_token(self) -> tuple | None:
        """O(1): the PeftModel's active adapter and the flags of one tuner layer (and one wrapper)."""
        if not self._sampled:
            return self._wrapper_state()
        return self._wrapper_state(), tuple(
            (as_names(getattr(m, "_active_adapter", None)), getattr(m, "_disable_adapters", False),
             tuple(getattr(m, "merged_adapters", ()))) for m in (layer.module for layer in self._sampled))

    # ---- what acts -----------------------------------------------------------------------------
    def prompt_adapter(self) -> str | None:
        """The PeftModel's active prompt-learning adapter (virtual tokens), if one acts."""
        wrapper = self.wrapper
        if wrapper is None or getattr(wrapper, "_adapters_disabled", False):
            return None
        names = as_names(getattr(wrapper, "active_adapter", None))
        config = self.configs.get(names[0]) if names else None
        return names[0] if config is not None and getattr(config, "is_prompt_learning", False) else None

    def prompt_tensors(self, name: str) -> list[tuple[str, torch.Tensor]]:
        encoders = getattr(self.wrapper, "prompt_encoder", None)
        if encoders is None or name not in encoders:
            return []
        module = encoders[name]
        return [(f"prompt_encoder.{name}.{n}", t) for n, t in list(module.named_parameters())
                + list(module.named_buffers())]

    def acting(self) -> tuple[dict[str, tuple[str, ...]], list[str], str | None]:
        """`({layer path: adapters applied there}, [paths that unmerge at their next forward],
        problem)`; problem names an acting adapter tiered_kv cannot identify."""
        per_layer = {}
        unmerging = []
        for layer in self.layers:
            names = layer.acting()
            if names:
                per_layer[layer.path] = names
            if layer.unmerges_at_forward():
                unmerging.append(layer.path)
        problem = self.problem
        names = {name for names in per_layer.values() for name in names}
        prompt = self.prompt_adapter()
        # a PeftModel's active adapter counts even where no layer shows it (adaption prompt, ...)
        wrapper = self.wrapper
        active = set(as_names(getattr(wrapper, "active_adapter", None))) \
            if wrapper is not None and not getattr(wrapper, "_adapters_disabled", False) else set()
        for name in sorted(names | active):
            if problem is not None:
                break
            peft_type = _peft_type(self.configs[name]) if name in self.configs else None
            if peft_type is not None and peft_type not in KNOWN_PEFT_TYPES | PROMPT_LEARNING_TYPES:
                problem = f"adapter {name!r} is of peft type {peft_type}, which tiered_kv does not identify"
        if problem is None:
            for layer in self.layers:
                if getattr(layer.module, "_disable_adapters", False) or getattr(layer.module, "merged_adapters", None):
                    continue
                missing = [n for n in as_names(getattr(layer.module, "_active_adapter", None)) if n not in names]
                missing = [n for n in missing if not any(other.holds(n) for other in self.layers)]
                if missing:
                    problem = f"adapter {missing[0]!r} is active but no layer of the model holds its weights"
                    break
        if problem is None and prompt is not None and not self.prompt_tensors(prompt):
            problem = f"prompt-learning adapter {prompt!r} is active but its prompt encoder is not reachable"
        return per_layer, unmerging, problem

    def tensors_of(self, name: str) -> list[tuple[str, torch.Tensor]]:
        """Adapter `name`'s tensors, by path."""
        out = self._tensors_of.get(name)
        if out is None:
            out = [item for layer in self.layers for item in layer.tensors_of(name)]
            out += self.prompt_tensors(name) if self.wrapper is not None else []
            self._tensors_of[name] = out
        return out

    def settings_of(self, name: str) -> list[str]:
        """Adapter `name`'s settings in every layer holding it, and its scalings (read anew: peft's
        set_scale / scale_layer change them in place)."""
        out = self._settings_of.get(name)
        if out is None:
            out = self._settings_of[name] = [text for layer in self.layers if layer.holds(name)
                                             for text in layer.settings_of(name)]
        return out + [f"scaling={[layer.scaling_of(name) for layer in self.layers]}"]

    def owned_tensor_ids(self) -> set[int]:
        """ids of every adapter's tensors (not part of the base weights' digest)."""
        if self._owned is not None:
            return self._owned
        owned = self._owned = set()
        for layer in self.layers:
            for attr in layer.containers:
                container = getattr(layer.module, attr, None)
                if isinstance(container, torch.nn.Module):
                    owned.update(id(t) for t in container.parameters())
                    owned.update(id(t) for t in container.buffers())
                elif isinstance(container, dict):
                    owned.update(id(v) for v in container.values() if isinstance(v, torch.Tensor))
        encoders = getattr(self.wrapper, "prompt_encoder", None) if self.wrapper is not None else None
        if isinstance(encoders, torch.nn.Module):
            owned.update(id(t) for t in encoders.parameters())
        return owned

    def config_text(self, name: str) -> str:
        """Adapter `name`'s peft config as JSON (minus fields that name files or versions)."""
        import json

        config = self.configs.get(name)
        if config is None or not hasattr(config, "to_dict"):
            return ""
        data = {k: v for k, v in config.to_dict().items()
                if k not in ("base_model_name_or_path", "revision", "inference_mode", "peft_version")}
        return json.dumps(data, sort_keys=True, default=_json_default)


def _json_default(value):
    if isinstance(value, (set, frozenset)):
        return sorted(repr(v) for v in value)
    return getattr(value, "value", None) or repr(value)
