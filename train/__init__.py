"""``specdec.train``: EAGLE-3 draft-head training (``specdec train-draft``) and the target's
supervised fine-tuning (``specdec train-sft``).

Installed from the top-level ``train/`` folder (package-dir mapping in pyproject.toml).
"""
