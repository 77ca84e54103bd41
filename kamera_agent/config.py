"""Window configuration: one frozen, validated object instead of keyword soup.

Why pydantic: a window's behaviour (capacity, patch rank and timing, what happens to survivors,
reorders and recalls) is chosen once and must be valid before the first push; a typo in a
policy name fails at construction with the list of known names, not deep inside an op.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kamera_agent.errors import ConfigError

if TYPE_CHECKING:
    from kamera_agent.store import ChunkStore

__all__ = [
    "FIDELITY_SETTINGS",
    "RENAMED_FIELDS",
    "RENAMED_VALUES",
    "STORE_FIELDS",
    "STORE_URL_VARIABLE",
    "WindowConfig",
]

STORE_FIELDS = (
    "memory_limit",
    "disk_dir",
    "disk_limit",
    "store_url",
    "store_secret",
    "store_previous_secrets",
)
"""The `WindowConfig` fields that describe the store a window builds (`WindowConfig.open_store`):
they apply to no window given a store of its own, and a server's one shared store is its own."""

STORE_URL_VARIABLE = "KAMERA_STORE_URL"
"""The environment variable a store's shared tier URL is read from when the settings name none."""

RENAMED_FIELDS = {"memory_budget": "memory_limit", "disk_budget": "disk_limit"}
"""Settings' old names → their names now: still taken, with a `DeprecationWarning`."""

RENAMED_VALUES = {("evicted_pixels", "keep"): "retain"}
"""(setting, old value) → its value now: still taken, with a `DeprecationWarning`."""

PatchMode = Literal["eager", "lazy", "none"]


def _deprecated(message: str) -> None:
    """Warn at the caller that built the settings (past pydantic's frames and this module's)."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(("pydantic", __name__)):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


class WindowConfig(BaseModel):
    """How a `KameraWindow` holds, moves, drops and brings back chunks.

    Attributes:
        capacity_chunks: most chunks in the window at once (``None``: unbounded).
        capacity_tokens: most cache slots the window's chunks may take (``None``: unbounded).
        rank: patch rank: an int, ``"full"`` (exact conditioning) or ``0`` (blind reuse).
        patch_mode: ``"eager"`` forms a chunk's patch at admission (from the conditioned
            forward the admission pays anyway), ``"lazy"`` at the next ``ask``/``kv``,
            ``"none"`` never (blind reuse).
        orbit: serve a reordered chunk whose antecedent *set* is unchanged with its orbit patch.
        eviction: eviction policy name (see ``kamera_agent.policies.EVICTION``) used when a push
            would exceed the capacity.
        survivors: what a slide or evict does to the chunks that stay (``SURVIVORS``).
        reorder: how a chunk whose antecedents changed is served when no stored patch fits
            (``REORDER``).
        recall_context: where a recalled chunk's patch comes from: ``"original"`` (its fixed
            earlier context: stored, free, never stale) or ``"current"`` (the chunks now left of it).
        cascade: re-admitting a chunk before in-window chunks re-patches them (``"cascade"``) or
            leaves them as they are (``"keep"``).
        probe_threshold: ``probe_without`` calls a chunk disposable below this next-token KL.
        max_new_tokens: answer length of an ``ask`` given no ``decode``.
        threads: torch threads to use (``None``: leave torch's setting).
        device: where the model runs (``None``: wherever it is).
        dtype: the model's dtype (``None``: as loaded); a loaded model is cast to it.
        memory_limit: bytes the chunk store holds in memory (``memory_budget``: its old name,
            still taken with a `DeprecationWarning`).
        disk_dir: a directory for the store's disk tier (``None``: memory only).
        disk_limit: bytes the disk tier may hold (``disk_budget``: its old name, likewise).
        store_url: a shared tier every process that names it reads and writes, or a list of
            them asked in order: a Valkey/Redis server or cluster (``redis://host:6379/0``,
            ``valkey://…``, ``redis+cluster://h1:p1,h2:p2``; options in
            `kamera_agent.store.remote.address`), an S3-compatible bucket
            (``s3://bucket/prefix?endpoint=…``, `kamera_agent.store.s3.address`), or any scheme
            registered in `kamera_agent.store.registry`; ``None``: the ``KAMERA_STORE_URL``
            environment variable (several URLs separated by spaces), else a store of this
            process alone.
        store_secret: a secret shared by every process of one deployment: entries written to
            disk or the shared tier are signed (a keyed MAC over address, model and payload) and
            entries read must verify, so a writer without it cannot plant a forged entry
            (`kamera_agent.store.signing`); ``None``: ``KAMERA_STORE_SECRET``, else unsigned
            (write access to the store is then full trust). Never printed.
        store_previous_secrets: secrets still accepted on read while a new ``store_secret``
            rolls out (``()``: ``KAMERA_STORE_PREVIOUS_SECRETS``, comma-separated).
        store_deadline_factor: a shared-store hit may take at most this many times what
            recomputing its tokens takes (the measured prefill time per token): one that would
            take longer is abandoned, counted, and computed locally (`kamera_agent.store.deadlines`).
        store_deadline_floor: seconds every shared-store lookup may take at least (a round trip
            and an entry's header), and all that one reading no payload may take.
        store_deadline_ceiling: seconds no shared-store lookup or write may take, and what one
            may take before any prefill was measured.
        max_evicted: most evicted chunks a window holds recallable (the oldest evicted are
            forgotten first, counted in ``stats``); ``None``: unbounded.
        max_image_pixels: images larger than this (width × height) are refused before decoding.
        large_chunk_tokens: pushing a chunk longer than this warns (`LargeChunkWarning`);
            ``None``: never. A chunk the model's context cannot hold is always refused.
        drift_budget: the largest estimated drift (relative KV error against a re-prefill of
            the same arrangement, `kamera_agent.fidelity`) any chunk may carry after an op: the
            window audits what it approximates and re-prefills from the first chunk over it.
            ``"calibrated"``: the budget the model's calibration chose (``kamera calibrate``); a
            number ε ≥ 0 (0: exact, the default of `exact`); ``None``: no budget (the policies'
            approximations unmeasured and unbounded). A model never calibrated runs exactly,
            with one `UncalibratedWarning` saying how to calibrate it.
        answer_budget: judge approximations by the answer instead (in place of
            ``drift_budget``, which engines keep using): the largest next-token KL against a
            re-prefill the window's estimate may reach after an op, where the estimated answer
            also has the same first token (`kamera_agent.fidelity.answer`: each approximated
            chunk's first rows recomputed, and they stay; a probe decoded before and after).
            Needs no calibration; ``None``: off.
        evicted_pixels: ``"drop"`` releases an evicted image's pixels once its vision output or
            canonical is stored (they are most of its memory); ``"retain"`` holds them, so its
            re-prefill inputs (``as_model_inputs``) can always be rebuilt (``"keep"``, its old
            name, still taken with a `DeprecationWarning`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, /, **data: Any) -> None:
        """Validate the settings; a refused value raises `ConfigError` (a `KameraError` and a
        ``ValueError``) naming each field and why, not pydantic's own exception."""
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise _config_error(error) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> WindowConfig:
        """`pydantic.BaseModel.model_validate`, refusing as the constructor does (`ConfigError`)."""
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as error:
            raise _config_error(error) from None

    capacity_chunks: int | None = Field(default=None, ge=1)
    capacity_tokens: int | None = Field(default=None, ge=1)
    rank: int | Literal["full"] = 32
    patch_mode: PatchMode = "eager"
    orbit: bool = True
    eviction: str = "fifo"
    survivors: str = "keep"
    reorder: str = "form"
    recall_context: Literal["original", "current"] = "original"
    cascade: Literal["cascade", "keep"] = "cascade"
    probe_threshold: float = Field(default=1e-2, ge=0.0)
    max_new_tokens: int = Field(default=32, ge=1)
    threads: int | None = Field(default=None, ge=1)
    device: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    memory_limit: int = Field(default=2 << 30, ge=1)
    disk_dir: Path | None = None
    disk_limit: int | None = Field(default=None, ge=1)
    store_url: str | tuple[str, ...] | None = None
    store_secret: SecretStr | None = None
    store_previous_secrets: tuple[SecretStr, ...] = ()
    store_deadline_factor: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    store_deadline_floor: float = Field(default=0.5, gt=0.0, allow_inf_nan=False)
    store_deadline_ceiling: float = Field(default=5.0, gt=0.0, allow_inf_nan=False)
    max_evicted: int | None = Field(default=1024, ge=0)
    evicted_pixels: Literal["drop", "retain"] = "drop"
    max_image_pixels: int = Field(default=50_000_000, ge=1)
    large_chunk_tokens: int | None = Field(default=8192, ge=1)
    drift_budget: float | Literal["calibrated"] | None = "calibrated"
    answer_budget: float | None = Field(default=None, gt=0, le=10)

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        """Settings under their old names (`RENAMED_FIELDS`, `RENAMED_VALUES`), with a
        `DeprecationWarning`: one word, one meaning (a byte cap is a limit, "keep" is what a
        survivor does with what it absorbed)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in RENAMED_FIELDS.items():
            if old in data:
                if new in data:
                    raise ValueError(f"{old} is the old name of {new}: set {new} alone")
                _deprecated(f"WindowConfig.{old} is now {new}")
                data[new] = data.pop(old)
        for (name, old), new in RENAMED_VALUES.items():
            if data.get(name) == old:
                _deprecated(f"{name}={old!r} is now {name}={new!r}")
                data[name] = new
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        """``True`` is not a count, a rank or a budget (pydantic would read it as 1)."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and "bool" not in str(field.annotation):
                    raise ValueError(f"{name} is not a flag: got {value!r}")
        return data

    @field_validator("rank")
    @classmethod
    def _rank_is_valid(cls, rank: int | str) -> int | str:
        if isinstance(rank, int) and rank < 0:
            raise ValueError("rank must be >= 0 (0 is blind reuse) or 'full'")
        return rank

    @field_validator("eviction", "survivors", "reorder")
    @classmethod
    def _policy_is_known(cls, name: str, info: Any) -> str:
        from kamera_agent import policies

        known = {
            "eviction": policies.EVICTION,
            "survivors": policies.SURVIVORS,
            "reorder": policies.REORDER,
        }[info.field_name]
        if name not in known:
            raise ValueError(f"unknown {info.field_name} policy {name!r}; known: {', '.join(sorted(known))}")
        return name

    @field_validator("drift_budget")
    @classmethod
    def _budget_is_valid(cls, budget: float | str | None) -> float | str | None:
        if isinstance(budget, float) and not (math.isfinite(budget) and budget >= 0):
            raise ValueError("drift_budget must be a finite number >= 0, 'calibrated' or None")
        return budget

    @field_validator("store_secret", "store_previous_secrets")
    @classmethod
    def _secrets_are_not_empty(
        cls, secret: SecretStr | tuple[SecretStr, ...] | None, info: Any
    ) -> SecretStr | tuple[SecretStr, ...] | None:
        """An empty secret would sign nothing and accept forged entries: refused by name."""
        secrets = secret if isinstance(secret, tuple) else (secret,)
        if any(each is not None and not each.get_secret_value() for each in secrets):
            said = "holds an empty secret" if isinstance(secret, tuple) else "is empty"
            raise ValueError(
                f"{info.field_name} {said}: an empty secret would sign nothing and accept forged "
                "entries; set a secret, or leave it unset for an unsigned store"
            )
        return secret

    @field_validator("store_url")
    @classmethod
    def _store_url_parses(cls, url: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
        """Each URL's scheme names a registered tier, which checks the rest (connecting to nothing)."""
        if url is not None:
            from kamera_agent.store.registry import TIERS

            if isinstance(url, tuple) and not url:
                raise ValueError("store_url is an empty list: name at least one URL, or leave it unset")
            for each in (url,) if isinstance(url, str) else url:
                TIERS.check(each)  # StoreURLError (a ValueError) names what is wrong
        return url

    @model_validator(mode="after")
    def _disk_settings_go_together(self) -> WindowConfig:
        if (self.disk_dir is None) != (self.disk_limit is None):
            raise ValueError("set disk_dir and disk_limit together (or neither)")
        return self

    @model_validator(mode="after")
    def _deadline_floor_below_ceiling(self) -> WindowConfig:
        if self.store_deadline_floor > self.store_deadline_ceiling:
            raise ValueError(
                f"store_deadline_floor ({self.store_deadline_floor} s) is above store_deadline_ceiling "
                f"({self.store_deadline_ceiling} s): the floor must not exceed the ceiling"
            )
        return self

    @property
    def memory_budget(self) -> int:
        """The old name of `memory_limit` (deprecated)."""
        warnings.warn("WindowConfig.memory_budget is now memory_limit", DeprecationWarning, stacklevel=2)
        return self.memory_limit

    @property
    def disk_budget(self) -> int | None:
        """The old name of `disk_limit` (deprecated)."""
        warnings.warn("WindowConfig.disk_budget is now disk_limit", DeprecationWarning, stacklevel=2)
        return self.disk_limit

    @property
    def effective_rank(self) -> int | Literal["full"]:
        """The rank patches are formed at: 0 whenever patching is off."""
        return 0 if self.patch_mode == "none" else self.rank

    @property
    def store_urls(self) -> tuple[str, ...]:
        """The shared tiers' URLs in the order a lookup asks them: ``store_url``, else
        ``KAMERA_STORE_URL`` (several separated by spaces), else none."""
        if self.store_url is not None:
            return (self.store_url,) if isinstance(self.store_url, str) else self.store_url
        return tuple(os.environ.get(STORE_URL_VARIABLE, "").split())

    @property
    def shared_store_url(self) -> str | None:
        """The shared tiers' URLs as one line (`store_urls`, space-separated), else ``None``."""
        return " ".join(self.store_urls) or None

    def open_store(
        self, fingerprint: str, *, disk: tuple[Path, int] | None = None, disk_shared: bool = False
    ) -> ChunkStore:
        """The store these settings describe for a model: memory, the disk tier, and the shared
        tier from `shared_store_url` (windows and engine adapters alike build their stores here).

        Args:
            fingerprint: the model's.
            disk: ``(directory, limit)`` of the disk tier in place of ``disk_dir`` and
                ``disk_limit`` (an engine's default store).
            disk_shared: every put is written to the disk tier at once, for the other processes
                of the machine (`ChunkStore`'s ``disk_shared``).

        Raises:
            StoreURLError: a store URL kamera cannot use.
            StoreDirectoryError: a disk directory kamera cannot use.
        """
        from kamera_agent.store import ChunkStore
        from kamera_agent.store.deadlines import DeadlineBounds

        disk_dir, disk_limit = disk if disk is not None else (self.disk_dir, self.disk_limit)
        return ChunkStore(
            fingerprint=fingerprint,
            memory_limit=self.memory_limit,
            disk_dir=disk_dir,
            disk_limit=disk_limit,
            disk_shared=disk_shared,
            urls=self.store_urls,
            secret=None if self.store_secret is None else self.store_secret.get_secret_value(),
            previous_secrets=[secret.get_secret_value() for secret in self.store_previous_secrets],
            deadlines=DeadlineBounds(
                self.store_deadline_factor, self.store_deadline_floor, self.store_deadline_ceiling
            ),
        )

    @classmethod
    def defaults(cls, **overrides: Any) -> WindowConfig:
        """The default trade, by name (``WindowConfig()`` is the same): rank-32 patches formed at
        admission, survivors keep what they absorbed, recalls use their original context,
        cascades, orbit patches for reorders within an antecedent set. Fewer forwards than
        `exact` where the model is calibrated (``drift_budget="calibrated"``: every chunk's
        estimated drift held within the calibration's budget); exact where it is not."""
        return cls(**overrides)

    @classmethod
    def exact(cls, **overrides: Any) -> WindowConfig:
        """Settings under which every op answers like a re-prefill of the window: full-rank
        patches, survivors re-patched without what left, recalls patched on their new left,
        cascades, no orbit approximation."""
        return cls(**{**EXACT_SETTINGS, **overrides})

    def exactly(self) -> WindowConfig:
        """These settings with every approximation off (`exact`'s), the rest as they are: what a
        window runs when its budget is 0 or its model has no calibration. A lazy patch timing
        stays (its patches are exact, formed at the read); no patching at all becomes eager."""
        update = {**EXACT_SETTINGS, "patch_mode": "eager" if self.patch_mode == "none" else self.patch_mode}
        return self.model_copy(update=update)

    @classmethod
    def for_model(cls, model: Any, **overrides: Any) -> WindowConfig:
        """A preset for a model: exact patches for tiny demo models, rank 32 otherwise."""
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        small = int(getattr(text, "hidden_size", 4096)) <= 256
        return cls(**{"rank": "full" if small else 32, **overrides})


FIDELITY_SETTINGS = (
    "rank",
    "patch_mode",
    "orbit",
    "survivors",
    "reorder",
    "recall_context",
    "cascade",
    "drift_budget",
    "answer_budget",
)
"""The settings that decide how faithful a window is to a re-prefill of it (what a request may
set for its own session in ``kamera serve``, and what a benchmark row names where it differs
from the defaults); the rest is the process's."""

EXACT_SETTINGS: dict[str, Any] = {
    "rank": "full",
    "survivors": "removal",
    "recall_context": "current",
    "cascade": "cascade",
    "orbit": False,
    "reorder": "form",
    "drift_budget": 0.0,
    "answer_budget": None,
}
"""What `WindowConfig.exact` sets: full-rank patches, survivors re-patched without what left,
recalls patched on their new left, cascades, no orbit approximation, reordered chunks formed
over their new left, a zero drift budget."""


def _config_error(error: ValidationError) -> ConfigError:
    problems = [
        f"{'.'.join(str(part) for part in problem['loc']) or 'WindowConfig'}: {problem['msg']}"
        for problem in error.errors()
    ]
    details: list[dict[str, object]] = [dict(problem) for problem in error.errors()]
    return ConfigError("invalid WindowConfig: " + "; ".join(problems), details)
