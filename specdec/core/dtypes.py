"""The compute dtypes a model can run in: one list for flags, configs and the loader (torch-free)."""

DTYPE_NAMES = ("float32", "bfloat16", "float16")
