"""Plain PyTorch (float64) reference of every Kimi K3 decode op; see the module docstrings."""
