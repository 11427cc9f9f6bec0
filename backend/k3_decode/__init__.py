"""Kimi K3 decode backend: shapes, kernels, selection and the selection trace."""
