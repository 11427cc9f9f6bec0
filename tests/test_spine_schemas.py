"""Generated JSON Schemas in schemas/ must match the models (regenerate: python -m k3fasttrack.schemas)."""

from k3fasttrack.models import Profile
from k3fasttrack.schemas import SCHEMA_DIR, render_all


def test_schemas_match_models() -> None:
    expected = render_all()
    on_disk = {p.name: p.read_text() for p in SCHEMA_DIR.glob("*.schema.json")}
    assert set(on_disk) == set(expected), "schema files differ from the artefact list"
    drifted = [name for name, text in expected.items() if on_disk[name] != text]
    assert not drifted, f"schemas drifted from the models: {drifted}; run python -m k3fasttrack.schemas"


def test_artefacts_are_frozen_and_closed() -> None:
    cfg = Profile.model_config
    assert cfg.get("frozen") is True and cfg.get("extra") == "forbid"
