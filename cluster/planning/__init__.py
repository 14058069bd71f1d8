"""Capacity planning: ``specdec profile`` (measure this machine), a discrete-event simulator of the
service that runs the router's own policy (:mod:`router.batching`,
:func:`specdec.core.prefill_plan.plan_prefill`, the core's k policy, the decisions of
:mod:`router.draft_depth`, :mod:`router.speculation_off`, :mod:`router.drafter_choice` and
:mod:`router.target_choice` as ``router.target_balance`` and ``router.drafter_pool`` apply them), and
``specdec plan`` (the cheapest deployment of a GPU catalog that meets latency and throughput
objectives).

* :mod:`.profile`: the profile a machine's measurements go into (JSON), torch-free.
* :mod:`.profiler`: taking a profile (loads the models; imports torch).
* :mod:`.catalog`: devices (bandwidth, FLOPs, memory, price) and model shapes, from ``catalog.yaml``.
* :mod:`.costs`: what a forward costs, from a profile or from a roofline model of a catalog device.
* :mod:`.workload`: arrivals, lengths and acceptance.
* :mod:`.policies`: the one place the simulator calls the router's policy.
* :mod:`.simulator`: the discrete-event simulation of a deployment; :mod:`.sim_drafting` its
  drafting, :mod:`.sim_entities` its workers, requests and target groups.
* :mod:`.predict`: a `specdec bench serve` run predicted from a profile, and put next to a measured one.
* :mod:`.planner` and :mod:`.plan_report`: the deployment search, its table, JSON and plots.
"""
