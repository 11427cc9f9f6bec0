"""Eval suites for the evals tier: suite files, dataset adapters, lm-eval driving, normalisation.

- ``suite``: ``load_suite(ref) -> Suite`` (frozen model of ``eval_suites/*.yaml``; one-line errors)
- ``datasets``: ``DataPaths.from_options(options)``, ``load_suite_data(suite, paths) -> SuiteData``
- ``gpqa``: the official password-protected zip, read in memory
- ``mrcr``: seeded MRCR-format data and MRCR's grading rule
- ``tasks``: lm-eval task objects over in-memory documents
- ``guard``: lm-eval clients that refuse to truncate prompts (``PromptTooLong``)
- ``runner``: ``evaluate`` one suite on one server, ``split_output`` into ``EvalSample`` records
- ``compare``: per-sample logs in the bundle and the paired comparison of a suite
"""
