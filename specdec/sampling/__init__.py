"""Token sampling shared by the engine and lossless acceptance: the filtered target
distribution and batched sampling (sampler.py), and seeded requests' counter-based
streams (seeded_stream.py). Acceptance verifies drafts against exactly what the sampler
draws from, so both sides import it from here; nothing here imports engine or spec."""
