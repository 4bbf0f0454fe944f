"""One peft tuner layer as adapters.py reads it, without importing peft: which adapters it holds
and applies now, their tensors, and their settings as text (what an adapter's digest covers).

A tuner layer keeps every adapter's state in per-adapter containers named by its
`adapter_layer_names` / `other_param_names` (LoRA's `lora_A`, `lora_B`, ...); a `modules_to_save`
wrapper keeps an adapter's own copy of a module. Which adapters act is a flag on the layer
(`_active_adapter`, `_disable_adapters`, `merged_adapters`).
"""

from __future__ import annotations

import torch

_NOT_SETTINGS = frozenset({"training", "scaling"})


def as_names(active) -> tuple[str, ...]:
    """An adapter flag (None, one name or several) as a tuple of names."""
    if active is None:
        return ()
    return (active,) if isinstance(active, str) else tuple(active)


class TunerLayer:
    """One tuner layer (or modules_to_save wrapper) of the runtime model."""

    __slots__ = ("path", "module", "is_wrapper", "containers")

    def __init__(self, path: str, module, is_wrapper: bool):
        self.path = path
        self.module = module
        self.is_wrapper = is_wrapper  # peft's ModulesToSaveWrapper: an adapter's own copy of a module
        names = ("modules_to_save",) if is_wrapper else \
            tuple(getattr(module, "adapter_layer_names", ())) + tuple(getattr(module, "other_param_names", ()))
        self.containers = names

    def state(self) -> tuple:
        """What decides what this layer computes, besides its tensors' contents (those have versions)."""
        module = self.module
        scaling = getattr(module, "scaling", None)
        return (as_names(getattr(module, "_active_adapter", None)), bool(getattr(module, "_disable_adapters", False)),
                tuple(getattr(module, "merged_adapters", ())),
                tuple(scaling.items()) if isinstance(scaling, dict) else None)

    def holds(self, name: str) -> bool:
        """Whether this layer has weights of adapter `name`."""
        module = self.module
        for attr in self.containers:
            container = getattr(module, attr, None)
            if isinstance(container, (torch.nn.ModuleDict, torch.nn.ParameterDict)) and name in container:
                return True
            if isinstance(container, dict) and isinstance(container.get(name), (torch.Tensor, torch.nn.Module)):
                return True
        return False

    def acting(self) -> tuple[str, ...]:
        """The adapters applied in this layer's forward now (merged ones act through the base weights)."""
        module = self.module
        active = as_names(getattr(module, "_active_adapter", None))
        if getattr(module, "_disable_adapters", False) or getattr(module, "merged_adapters", None):
            return ()
        if self.is_wrapper:  # the first active adapter's copy, if the wrapper holds every active one
            return active[:1] if active and all(self.holds(name) for name in active) else ()
        return tuple(name for name in active if self.holds(name))

    def unmerges_at_forward(self) -> bool:
        """Disabled with adapters merged: peft unmerges them in the next forward (the base weights
        change under that very step)."""
        module = self.module
        return bool(getattr(module, "_disable_adapters", False) and getattr(module, "merged_adapters", None))

    def scaling_of(self, name: str):
        scaling = getattr(self.module, "scaling", None)
        return scaling.get(name) if isinstance(scaling, dict) else None

    def tensors_of(self, name: str) -> list[tuple[str, torch.Tensor]]:
        """Adapter `name`'s tensors in this layer, by path."""
        out = []
        for attr in self.containers:
            container = getattr(self.module, attr, None)
            if not hasattr(container, "keys") or name not in container.keys():
                continue
            value = container[name]
            prefix = f"{self.path}.{attr}.{name}"
            if isinstance(value, torch.Tensor):
                out.append((prefix, value))
            elif isinstance(value, torch.nn.Module):
                out += [(f"{prefix}.{n}", t) for n, t in value.named_parameters()]
                out += [(f"{prefix}.{n}", t) for n, t in value.named_buffers()]
        return out

    def settings_of(self, name: str) -> list[str]:
        """Adapter `name`'s other settings in this layer (rank, alpha, scaling, dropout, DoRA...) and
        the layer's own (fan_in_fan_out, ...), as text."""
        module = self.module
        out = [f"{self.path}|{type(module).__module__}.{type(module).__qualname__}"]
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_") or attr in _NOT_SETTINGS:  # (scaling: scaling_of, read at every recompute)
                continue
            if isinstance(value, dict) and name in value:
                out.append(f"{attr}[{name}]={_setting_text(value[name])}")
            elif value is None or isinstance(value, (bool, int, float, str)):
                out.append(f"{attr}={value!r}")
        for attr in self.containers:
            container = getattr(module, attr, None)
            if isinstance(container, torch.nn.ModuleDict) and name in container:
                out.append(f"{attr}[{name}]={_setting_text(container[name])}")
        return out


def _setting_text(value) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"  # its values are sampled with the adapter's tensors
    if isinstance(value, torch.nn.Module):  # e.g. dropout: its class and settings
        return f"{type(value).__qualname__}({value.extra_repr()})"
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(_setting_text(v) for v in value) + "]"
    return f"{type(value).__module__}.{type(value).__qualname__}"  # e.g. a LoRA variant (stateless)
