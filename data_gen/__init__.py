"""``specdec.data_gen``: training data for EAGLE-3 heads, in four resumable stages
(``specdec data-gen ...``; installed from the top-level ``data_gen/`` folder):

1. ``prompts.py``    sources (``sources.py``, the offline mix in ``mix.py``) → deduplicated,
                     decontaminated (``decontam.py``) conversations in JSONL shards;
2. ``regenerate.py`` every user turn answered by the target on the engine; token ids and
                     the assistant loss mask (``chat.py``);
3. ``dump.py``       the target's aux residual streams and final hidden state per token, in
                     safetensors shards (planned by ``dump_plan.py``);
4. ``vocab.py``      the draft vocabulary map (d2t / t2d) from loss-token frequencies.

Every stage writes through ``shards.py`` (atomic shards, checksummed completion markers,
rank ownership) and ends in ``stage.py`` (plan and manifest merge).
"""
