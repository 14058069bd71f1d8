"""The target worker: the large model, where verification happens (docs/design.md, invariant 3).

* :mod:`target_worker.servicer`: ``TargetServicer`` (specdec.v1.TargetService) over a
  :class:`specdec.core.target.TargetVerifier`.
* :mod:`target_worker.actor`: the ``TargetWorker`` Ray actor and :func:`spawn_target_worker`.
* ``python -m target_worker --model ...``: the same server without Ray.

Importing this package does not import torch or Ray (the launcher that spawns actors may be a
torch-free process); the servicer module and the actor's constructor do.
"""

from target_worker.actor import TargetWorker, spawn_target_worker

__all__ = ["TargetWorker", "spawn_target_worker"]
