"""The core: models, packs, runner, sampling, verification, drafters, adaptive k, the engine.

Free of grpc, Ray and pynvml, and of everything above it (checked by import-linter in `make test`).
"""
