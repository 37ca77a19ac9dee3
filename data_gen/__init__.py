"""``specdec.data_gen``: prompts → target-regenerated conversations → hidden-state shards
and the draft vocabulary. Installed from the top-level ``data_gen/`` folder; the pipelines
land with the data_gen issue."""
