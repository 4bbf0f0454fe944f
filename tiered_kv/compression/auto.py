"""`compression: auto` resolved, and explicit lossy modes checked, on the model a store first serves.

A store's tiers are built for one layout, so what warm, cold and remote store a block as is settled
before the store binds (`TierStore.bind`): a bank built from a model (`CacheBank(model, cfg,
tokenizer=...)`) calls `CompressionChoice.prepare` first, and `bound_config` hands the store its
config with every `auto` replaced by the mode chosen. The choice is the smallest lossy mode whose
next-token agreement with the uncompressed cache meets `compression.quality_floor` on this model
(calibration.py measures it over a text shipped in the package), else `none`.

Measurements are kept per model fingerprint (weights, config, block size, KV dtype), calibration
text, token count, block size and codec version: in this process (a second store or bank measures
nothing) and in the record beside the cold tier's files (record.py: a restart measures nothing).
With `compression.check_explicit`, an explicit fp8/int8/int4 tier is measured the same way (when a
tokenizer is at hand) and warns once per model and mode when it falls below the floor; it never
fails. A store bound with `auto` and no model to measure (`store.bind()` alone, a bank built from
a model config) raises ConfigError: nothing was written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time

from ..config import Config
from ..config.checks import COMPRESSION_AUTO
from ..errors import ConfigError
from ..logs import log_once
from . import CODEC_VERSION, MODES, check_shape
from .calibration import Calibration, Calibrator, modes_by_size
from .record import Record, entry_key

log = logging.getLogger(__name__)

LOSSY_MODES = MODES[1:]
TIER_KEYS = ("warm", "cold", "remote")  # the config sections with a `compression`
_PROCESS_LOCK = threading.Lock()  # one calibration at a time in this process
_MEMO: dict[str, tuple[dict, str]] = {}  # entry key -> (entry, "calibrated" | "record"), this process


def forget_measurements() -> None:
    """Forget what this process measured or read (tests: the next store reads the record again)."""
    with _PROCESS_LOCK:
        _MEMO.clear()


def _one_or_each(values: dict[str, str | None]):
    """One value when every tier has it, else {tier: value}."""
    return next(iter(values.values())) if len(set(values.values())) == 1 else dict(values)


class CompressionChoice:
    """What one store's warm, cold and remote tiers store a block as (see the module docstring)."""

    def __init__(self, config: Config, cold_directory=None):
        self.config = config
        self.requested = {key: getattr(config, key).compression for key in TIER_KEYS}
        directory_fd = getattr(cold_directory, "fd", None)
        self.record = Record(directory_fd, cold_directory.path) if directory_fd is not None else None
        self.modes: dict[str, str] | None = None if self.has_auto else dict(self.requested)
        self.calibration: Calibration | None = None  # the figures behind the choice or the checks
        self.source = "explicit"  # "calibrated" or "record" once auto is resolved
        self._lock = threading.Lock()
        self._prepared = False

    @property
    def has_auto(self) -> bool:
        return COMPRESSION_AUTO in self.requested.values()

    @property
    def measured(self) -> dict[str, float]:
        return dict(self.calibration.agreement) if self.calibration is not None else {}

    def _auto_keys(self) -> str:
        return " and ".join(f"'{key}.compression'" for key, mode in self.requested.items() if mode == COMPRESSION_AUTO)

    # ---- before the store binds ----------------------------------------------------------------
    def prepare(self, model, tokenizer, root_hex: str | None, layout) -> None:
        """Resolve `auto` on `model` (and check explicit lossy modes) for the store's `layout` (model
        dtype); at most once per store. `root_hex`: the model fingerprint's root key (None: its
        weights cannot be named, so nothing is read from or written to the record). ConfigError when
        `auto` needs a tokenizer that is not there, or the calibration text is too short."""
        settings = self.config.compression
        auto_modes = modes_by_size(layout.num_kv_heads, layout.block_size, layout.head_dim) if self.has_auto else []
        explicit = sorted({m for m in self.requested.values() if m in LOSSY_MODES}) if settings.check_explicit else []
        with self._lock:
            if self._prepared or not (auto_modes or explicit):
                return
            key = entry_key(root_hex or f"unnamed-{id(model)}", settings.calibration_text,
                            settings.calibration_tokens, layout.block_size, CODEC_VERSION)
            training = bool(getattr(model, "training", False))  # (measured as it serves: without dropout)
            with _PROCESS_LOCK, _evaluating(model, training):
                calibration, source = self._measurements(key, root_hex is not None, layout.block_size)
                known = dict(calibration.agreement)
                run = _Run(model, tokenizer, settings, layout.block_size, calibration)
                chosen = None
                if auto_modes:
                    chosen = calibration.choice(settings.quality_floor, auto_modes)
                    if chosen is None:
                        run.calibrator(required=self._auto_keys()).choose(settings.quality_floor, auto_modes)
                        chosen = calibration.choice(settings.quality_floor, auto_modes)
                for mode in explicit:
                    if mode not in calibration.agreement and run.calibrator(required=None) is not None:
                        run.calibrator(required=None).measure(mode)
                if calibration.agreement != known:
                    source = "calibrated"
                    self._keep(key, calibration, chosen, root_hex is not None)
            self.calibration, self._prepared = calibration, True
            if auto_modes:
                self.modes = {k: (chosen if m == COMPRESSION_AUTO else m) for k, m in self.requested.items()}
                self.source = source
                log.info("compression: auto chose %r (%s) for this model: agreement %s at quality_floor %s",
                         chosen, source, calibration.agreement, settings.quality_floor)
        for mode in explicit:
            self._check_explicit(mode, key, auto_modes or modes_by_size(layout.num_kv_heads, layout.block_size,
                                                                        layout.head_dim))

    def _measurements(self, key: str, named: bool, block_size: int) -> tuple[Calibration, str]:
        """What this process or the record knows of `key` (a fresh Calibration when nothing)."""
        settings = self.config.compression
        known = _MEMO.get(key) if named else None  # (a model whose weights have no name is measured per store)
        if known is None and named and self.record is not None:
            entries, problem = self.record.read(LOSSY_MODES)
            if problem is not None:
                log_once(log, logging.WARNING, "compression record %s is not trusted (%s): what it holds is "
                         "measured again and the file rewritten", self.record.path, problem)
            if key in entries:
                known = _MEMO[key] = (entries[key], "record")
        if known is None:
            return Calibration(settings.calibration_text, 0, block_size), "calibrated"
        entry, source = known
        return Calibration(settings.calibration_text, int(entry.get("tokens_used", 0)), block_size,
                           dict(entry["agreement"]), dict(entry["ppl_ratio"]), float(entry.get("seconds", 0.0))), source

    def _keep(self, key: str, calibration: Calibration, chosen: str | None, named: bool) -> None:
        settings = self.config.compression
        entry = {"fingerprint": key.split("|", 1)[0], "text": settings.calibration_text,
                 "tokens": settings.calibration_tokens, "tokens_used": calibration.tokens,
                 "block_size": calibration.block_size, "codec_version": CODEC_VERSION,
                 "agreement": dict(calibration.agreement),
                 "ppl_ratio": {m: (r if math.isfinite(r) else None) for m, r in calibration.ppl_ratio.items()},
                 "floor": settings.quality_floor, "chosen": chosen, "seconds": calibration.seconds,
                 "time": time.time()}
        if not named:
            return
        _MEMO[key] = (entry, "calibrated")
        if self.record is None:
            log_once(log, logging.INFO, "compression: no cold directory to record the calibration in; it is "
                     "kept in this process only")
            return
        problem = self.record.write(key, entry, LOSSY_MODES)
        if problem is not None:
            log_once(log, logging.WARNING, "compression record %s cannot be written (%s): the calibration is "
                     "kept in this process only, and runs again in the next", self.record.path, problem)

    def _check_explicit(self, mode: str, key: str, by_size: list[str]) -> None:
        settings, calibration = self.config.compression, self.calibration
        agreement = calibration.agreement.get(mode)
        if agreement is None or agreement >= settings.quality_floor:
            return
        tiers = " and ".join(f"'{k}.compression'" for k, m in self.requested.items() if m == mode)
        larger = by_size[by_size.index(mode) + 1:] if mode in by_size else []
        ratio = calibration.ppl_ratio.get(mode)
        log_once(log, logging.WARNING,
                 "compression: %s %r agrees with the uncompressed cache on %.2f%% of next tokens on this model "
                 "(fingerprint %s), below compression.quality_floor %.2f%% (perplexity ratio %s, over %d tokens of "
                 "the calibration text %r); use a larger mode (%s) or compression: auto, or lower the floor",
                 tiers, mode, 100 * agreement, key.split("|", 1)[0][:16], 100 * settings.quality_floor,
                 "unknown" if ratio is None else f"{ratio:.4f}", calibration.tokens, settings.calibration_text,
                 ", ".join([*larger, "none"]))

    # ---- binding -------------------------------------------------------------------------------
    def bound_config(self, layout) -> Config:
        """The config the tiers are built from: every `auto` replaced by the mode chosen. ConfigError
        when `auto` was not resolved (nothing measured a model) or a tier's mode cannot hold `layout`."""
        if self.modes is None:
            raise ConfigError(
                f"config key {self._auto_keys()}: got 'auto', which is resolved on the model a store first serves "
                "(it measures what each mode costs that model, with its tokenizer); this store was bound without "
                "one (store.bind() alone, or a CacheBank built from a model config). Build the first bank as "
                "CacheBank(model, cfg, tokenizer=tokenizer), or give a mode: 'none', 'fp8', 'int8' or 'int4'")
        for key, mode in self.modes.items():
            problem = check_shape(mode, layout.head_dim) if mode in LOSSY_MODES else None
            if problem is not None:
                usable = [m for m in MODES if m == "none" or check_shape(m, layout.head_dim) is None]
                raise ConfigError(f"config key '{key}.compression': got {mode!r}, which cannot store this model's KV "
                                  f"({problem}); allowed for this model: "
                                  f"{', '.join(map(repr, [*usable, COMPRESSION_AUTO]))}")
        if not self.has_auto:
            return self.config
        config = self.config
        return config.replace(**{key: dataclasses.replace(getattr(config, key), compression=self.modes[key])
                                 for key, mode in self.requested.items() if mode == COMPRESSION_AUTO})

    # ---- reporting -------------------------------------------------------------------------------
    def report(self) -> dict:
        """stats()["compression"]: the mode per tier (one value when all agree; None before `auto` is
        resolved), what the config asked, the floor, each mode's measured agreement and perplexity
        ratio, the seconds calibration took, and where the figures came from."""
        calibration = self.calibration
        return {"mode": _one_or_each(self.modes) if self.modes is not None else None,
                "requested": _one_or_each(self.requested),
                "quality_floor": self.config.compression.quality_floor,
                "measured": self.measured,
                "ppl_ratio": dict(calibration.ppl_ratio) if calibration is not None else {},
                "calibration_s": calibration.seconds if calibration is not None else 0.0,
                "source": self.source}


@contextlib.contextmanager
def _evaluating(model, training: bool):
    """`model` in eval mode inside (when it was training), as it was after."""
    if training:
        model.eval()
    try:
        yield
    finally:
        if training:
            model.train()


class _Run:
    """The calibrator of one `prepare`, made on first need (it tokenizes the text)."""

    def __init__(self, model, tokenizer, settings, block_size: int, calibration: Calibration):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.block_size, self.calibration = block_size, calibration
        self._calibrator: Calibrator | None = None
        self._tried, self._why = False, None

    def calibrator(self, required: str | None) -> Calibrator | None:
        """The calibrator; None without a tokenizer, unless `required` (the auto keys): ConfigError."""
        if self._calibrator is None and not self._tried:
            self._tried = True
            tokenizer, why = self.tokenizer, None
            if tokenizer is None:
                tokenizer, why = _auto_tokenizer(self.model)
            if tokenizer is not None:
                self._calibrator = self._make(tokenizer)
            else:
                self._why = why
                log_once(log, logging.INFO, "compression: no tokenizer for this model (%s), so its explicit lossy "
                         "modes are not measured against compression.quality_floor; pass tokenizer= to CacheBank "
                         "to check them", why)
        if self._calibrator is None and required is not None:
            raise ConfigError(
                f"config key {required}: got 'auto', which measures the model on the text "
                f"{self.settings.calibration_text!r} before the store binds, and needs its tokenizer: pass "
                f"tokenizer= to CacheBank (none was given, and {self._why}); or give a mode: 'none', 'fp8', "
                "'int8' or 'int4'")
        return self._calibrator

    def _make(self, tokenizer) -> Calibrator:
        settings = self.settings
        text = settings.text_path().read_text(encoding="utf-8")
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :settings.calibration_tokens]
        try:
            calibrator = Calibrator(self.model, ids, self.block_size, settings.calibration_text)
        except ValueError as exc:
            raise ConfigError(f"config key 'compression.calibration_text': got {settings.calibration_text!r}, "
                              f"too short for this tokenizer ({exc})") from None
        self.calibration.tokens = calibrator.result.tokens
        calibrator.result = self.calibration  # what is known already is not measured again
        return calibrator


def _auto_tokenizer(model):
    """(the tokenizer saved beside the model's weights, None) or (None, why not)."""
    name = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    if not name:
        return None, "the model has no name_or_path to load one from"
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name, local_files_only=True), None
    except Exception as exc:  # (any failure: not there, not offline, not a tokenizer)
        return None, f"AutoTokenizer.from_pretrained({name!r}, local_files_only=True) failed: {type(exc).__name__}"
