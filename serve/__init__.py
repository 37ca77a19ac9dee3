"""``specdec.serve``: the OpenAI-compatible server (``specdec serve``) and its load
generator (``specdec bench-serve``). Installed from the top-level ``serve/`` folder.

- ``config.py``: ``ServeConfig`` (YAML in configs/serve/ maps onto it)
- ``async_engine.py``: the engine loop on a background thread, one stream per request
- ``protocol.py``: OpenAI request/response bodies (pydantic)
- ``inputs.py``: request bodies → prompt token ids and ``SamplingParams``
- ``serving.py``: completions and chat handlers, SSE streaming
- ``errors.py``, ``auth.py``, ``metrics.py``: error bodies, API keys, Prometheus
- ``app.py``: ``build_app`` (FastAPI) and ``run_server`` (uvicorn)
- ``cli.py``, ``bench.py``: the two commands
"""
