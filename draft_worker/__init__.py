"""The draft worker: a small model (or n-gram) drafter that proposes tokens for the target.

* :mod:`draft_worker.servicer`: ``DraftServicer`` (specdec.v1.DraftService) over a
  :class:`specdec.core.drafters.ModelDrafter` or :class:`specdec.core.drafters.NgramProposer`.
* :mod:`draft_worker.actor`: the ``DraftWorker`` Ray actor and :func:`spawn_draft_worker`.
* ``python -m draft_worker --model ...``: the same server without Ray.

Importing this package does not import torch or Ray; the servicer module and the actor's
constructor do.
"""

from draft_worker.actor import DraftWorker, spawn_draft_worker

__all__ = ["DraftWorker", "spawn_draft_worker"]
