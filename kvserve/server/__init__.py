"""The OpenAI-compatible HTTP server: the engine thread (``AsyncEngine``), the API, metrics, ``kvserve serve``.

The only package that imports the web framework (FastAPI, Starlette, uvicorn).
"""
