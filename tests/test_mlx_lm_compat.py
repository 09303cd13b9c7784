"""Every touch point the engine takes from mlx-lm beyond its public API still exists in the
installed mlx-lm (servicer/engine/mlx_lm_compat.py): an upgrade that moves one fails here."""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

from servicer.engine import mlx_lm_compat
from servicer.engine.mlx_lm_compat import TOUCH_POINTS, missing_touch_points


def test_every_touch_point_exists_in_the_installed_mlx_lm():
    assert missing_touch_points() == []


def test_a_moved_touch_point_is_named(monkeypatch):
    moved = (*TOUCH_POINTS, (KVCache, "_gone_in_a_later_mlx_lm", "nothing"))
    monkeypatch.setattr(mlx_lm_compat, "TOUCH_POINTS", moved)
    assert missing_touch_points() == ["KVCache._gone_in_a_later_mlx_lm"]
