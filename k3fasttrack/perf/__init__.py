"""The perf tier's machinery: sweep grids, prompt sets, the ``vllm bench serve`` driver, the
harness runner protocol, the agentic workload, statistics glue, plots and same-path checks.

The tier itself (cells, report) lives in ``k3fasttrack.tiers.perf``; measured facts in NOTES.md.
"""
