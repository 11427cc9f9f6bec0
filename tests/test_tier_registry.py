"""The registry names every tier once, and each name loads that tier's spec."""

from k3fasttrack.models.base import TIER_ORDER
from k3fasttrack.tiers.registry import RUN_ORDER, TIERS, load_spec


def test_every_tier_is_registered_under_its_name() -> None:
    assert set(TIERS) == set(TIER_ORDER) == set(RUN_ORDER)
    for name in TIERS:
        spec = load_spec(name)
        assert spec is not None and spec.name == name


def test_unknown_name_has_no_spec() -> None:
    assert load_spec("nonexistent") is None  # type: ignore[arg-type]
