"""``specdec.serve``: the OpenAI-compatible server (``specdec serve``). Installed from the
top-level ``serve/`` folder; the server lands with the serve issue."""
