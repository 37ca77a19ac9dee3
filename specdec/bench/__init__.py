"""``specdec.bench``: ``specdec bench``, speculative against plain decoding over benchmark
prompt sets, and the helpers the notebooks in notebooks/ read its reports with.

- ``sets/``: the registry of prompt sets (one loader per file) and prompt files
- ``config.py``: ``BenchConfig``, tree-shape sweeps, config labels
- ``driver.py``: the request loop (concurrency window) and one timed run
- ``measure.py``: interleaved timing, medians, agreement with plain decoding
- ``passes.py``: untimed analysis passes (step traces, target entropy, vocab coverage)
- ``peers.py``: HF transformers generate / prompt lookup / assisted generation
- ``report.py``: the JSON schema (dataclasses) and the Markdown table
- ``runner.py``: ``run_bench``, everything in order; ``cli.py``: the command
- ``analysis.py``: pure functions over a report, for notebooks
- ``env.py``: versions, hardware, commit and command line of a figure

Terms as in docs/DESIGN.md: a *step* is one verification of one request's draft; τ = 1 +
accepted / steps; a_k = fraction of steps accepting at least k drafts; speedup = spec
tokens/s ÷ plain tokens/s, measured interleaved in one run (medians of repeats).
"""
