"""``specdec-client``: the repository's own client modules, packaged from where they live (one copy).

The wheel holds the modules :mod:`specdec.rpc.client` and :mod:`specdec.rpc.aio_client` import and
nothing else of their packages (``CLIENT_MODULES``), so it installs and imports without torch, Ray
or transformers; tests/integration/test_client_dist.py builds it, installs it into a fresh venv
and runs both clients against a real router.
"""

from __future__ import annotations

from setuptools import setup
from setuptools.command.build_py import build_py

CLIENT_MODULES = {
    "specdec": ["__init__"],
    "specdec.core": ["__init__", "params", "round_types", "token_tree"],
    "specdec.rpc": [
        "__init__",
        "aio_client",
        "auth",
        "call_metadata",
        "client",
        "client_credentials",
        "client_errors",
        "convert",
        "grpc_options",
    ],
    "specdec.rpc.v1": ["__init__", "generate_pb2", "generate_pb2_grpc", "worker_pb2", "worker_pb2_grpc"],
}


class ClientModulesOnly(build_py):
    """The listed modules of each package, not every module the package directory holds."""

    def find_package_modules(self, package, package_dir):
        keep = set(CLIENT_MODULES.get(package, ()))
        return [m for m in super().find_package_modules(package, package_dir) if m[1] in keep]


setup(
    packages=list(CLIENT_MODULES),
    package_dir={p: "../../" + p.replace(".", "/") for p in CLIENT_MODULES},  # relative: setuptools wants it
    cmdclass={"build_py": ClientModulesOnly},
)
