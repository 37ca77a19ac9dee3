"""``specdec.serve``: the OpenAI-compatible server (``specdec serve``) and its load
generator (``specdec bench-serve``). Installed from the top-level ``serve/`` folder.

- ``config.py``: ``ServeConfig`` (YAML in configs/serve/ maps onto it)
- ``engine_core.py``: the engine loop (``EngineCore``) and its process entry point; one
  message per step with every request's new token ids
- ``core_client.py``: the core in its own process (default) or on a thread
- ``async_engine.py``: the API side: detokenizing, stop strings, one stream per request
- ``protocol.py``: OpenAI request/response bodies (pydantic)
- ``inputs.py``: request bodies → prompt token ids and ``SamplingParams``
- ``serving.py``: completions and chat handlers, SSE streaming
- ``tokenize.py``: vLLM's /tokenize and /detokenize
- ``errors.py``, ``auth.py``, ``metrics.py``: error bodies, API keys, Prometheus
- ``launch.py``: the start-up order: the engine core spawned first, the tokenizer on a
  thread, before the HTTP stack is imported
- ``app.py``: ``build_app`` (FastAPI) and ``run_server`` (uvicorn)
- ``cli.py``, ``bench.py``: the two commands
"""
