"""What a tier runs against: its context (``TierContext``), the run folder's cell store, the
progress display and atomic file writes. Below the serving layer and the tiers, above the models
(the layer order is in ``tests/test_layering.py``)."""
