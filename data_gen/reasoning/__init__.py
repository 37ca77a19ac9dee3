"""Reasoning traces: reasoning-gym tasks solved step by step in ``<think>`` format.

``format`` defines the reply layout (render / parse), ``tasks`` the registry of tasks and
their tracers (``arithmetic``, ``number_theory``, ``symbolic``), ``generate`` the seeded,
split, decontaminated, resumable JSONL writer behind ``specdec data-gen reasoning-traces``,
``confidence`` the SpecExit confidence labels of a target's own reasoning behind ``specdec
data-gen exit-labels``.
"""
