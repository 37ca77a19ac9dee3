"""``specdec.train``: EAGLE-3 draft-head training (``specdec train-draft``).

Installed from the top-level ``train/`` folder. Training lands with the train-draft issue;
the package exists now so the layout in docs/DESIGN.md installs as documented.
"""
