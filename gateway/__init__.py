"""The OpenAI-compatible HTTP API: an ASGI app (FastAPI, served by uvicorn in its own process) over
an async gRPC client of the router. It translates and relays; the router stays the only scheduler
and validator, and writes the access line of every request it sees (the gateway only those of the
requests it refuses itself; docs/design.md, The HTTP API). It imports specdec.rpc and the core's log
format only: no torch, transformers or Ray (pyproject.toml's import contracts).
"""
