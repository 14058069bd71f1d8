"""The OpenAI-compatible HTTP API: an ASGI app (FastAPI, served by uvicorn in its own process) over
an async gRPC client of the router. It translates and relays; the router stays the only scheduler,
validator and access log (docs/design.md, The API). It imports specdec.rpc only: no torch,
transformers or Ray (pyproject.toml's import contracts).
"""
