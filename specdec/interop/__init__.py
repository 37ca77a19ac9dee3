"""EAGLE-3 heads across engines: export for vLLM/SGLang/EAGLE, import of published heads,
and a validator that names what would break and how to fix it.

- ``consumers.py``: the registry of engines that load heads (formats, rules, launch lines).
- ``validate.py``: ``validate_head`` and its ``Finding``s.
- ``export.py`` / ``importer.py``: the conversions, built on ``models/eagle3_formats.py``.
- ``target.py``: which target model a head is checked against.
- ``cli.py``: ``specdec export``, ``specdec import``, ``specdec validate-head``.
"""
