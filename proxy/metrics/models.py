"""The `model` label: a bounded set learnt from the engine's /v1/models, or configured."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from proxy.metrics.labels import OTHER

# The engine's model list is learnt again this often (a LoRA adapter may have been loaded). While it
# is not known yet (the engine was down when the sidecar started) every scrape retries, and the hot
# path starts a background retry at most this often.
MODELS_REFRESH_S = 60.0
MODELS_RETRY_S = 5.0


class ModelLabels:
    """Maps a request's `model` to a bounded label value: an allowed id, else `other`.

    The allowed ids are `metrics_models` when configured; otherwise the ids the engine
    lists at `/v1/models`, at most `metrics_max_models` of them over the process's
    whole life, so a label never takes request-controlled text and never grows unbounded.
    """

    def __init__(self, allow: tuple[str, ...], max_models: int) -> None:
        """Start from the configured allow-list (empty: learn the engine's ids)."""
        self.configured = bool(allow)
        self._ids: dict[str, str] = {name: name for name in allow}
        self._max = max_models
        self.refreshed_at = -math.inf  # monotonic time of the last successful listing
        self.tried_at = -math.inf

    @property
    def known(self) -> bool:
        """Whether the allowed ids are settled: configured, or listed by the engine once."""
        return self.configured or self.refreshed_at > -math.inf

    @property
    def ids(self) -> tuple[str, ...]:
        """The allowed ids, in the order they were learnt."""
        return tuple(self._ids)

    def label(self, model: str | None) -> str:
        """The label for a request's model; a request without one on a one-model engine is that model."""
        if model is None:
            return next(iter(self._ids)) if len(self._ids) == 1 else OTHER
        return self._ids.get(model, OTHER)

    def learn(self, listed: Iterable[str]) -> list[str]:
        """Add the engine's listed ids while room is left; return those that are new."""
        added: list[str] = []
        for model in listed:
            if len(self._ids) >= self._max:
                break
            if model not in self._ids:
                self._ids[model] = model
                added.append(model)
        self.refreshed_at = time.monotonic()
        return added

    def due(self, now: float, retry_s: float) -> bool:
        """Whether the engine's list should be fetched now: retried after `retry_s` while unknown."""
        if self.configured:
            return False
        if not self.known:
            return now - self.tried_at >= retry_s
        return now - self.refreshed_at >= MODELS_REFRESH_S
