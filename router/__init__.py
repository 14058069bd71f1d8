"""The router: the public ``specdec.v1.Generation`` API over disaggregated draft and target workers.

* :mod:`router.server`: :class:`~router.server.Router` (worker clients, schedulers, gRPC server,
  metrics) and :class:`~router.server.RouterThread`; :class:`~router.server.TargetBinding` says
  where a target worker and its draft worker are.
* :mod:`router.scheduler`: continuous batching, pipelined rounds, pre-drafting, fail open.
* :mod:`router.service`: the grpc.aio servicer. :mod:`router.validate`: request checks.
* :mod:`router.workers`: endpoints (Ray actor handles or fixed addresses) and worker clients.
* :mod:`router.metrics`: Prometheus series. :mod:`router.detok`: text from token ids.
* :mod:`specdec.bench.serve`: ``specdec bench serve``.

Rules of the house: no torch (not even transitively), no Ray import, never draft_worker /
target_worker; the router moves token ids and small sparse distributions only.
"""
