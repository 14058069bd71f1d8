"""Capacity planning: ``specdec profile`` (measure this machine), a simulator of the service that
runs the router's own scheduler, drafting and rebalancer on a simulated clock, and ``specdec plan``
(the cheapest deployment of a GPU catalog that meets latency and throughput objectives).

* :mod:`.profile`: the profile a machine's measurements go into (JSON), torch-free.
* :mod:`.profiler`: taking a profile (loads the models; imports torch).
* :mod:`.catalog`: devices (bandwidth, FLOPs, memory, price) and model shapes, from ``catalog.yaml``.
* :mod:`.costs`: what a forward costs, from a profile or from a roofline model of a catalog device.
* :mod:`.workload`: arrivals, lengths and acceptance.
* :mod:`.simulator`: a deployment simulated by the router's own code; :mod:`.virtual_loop` the
  event loop on simulated time it runs on, :mod:`.sim_workers` the workers it calls (over the
  processor-sharing devices of :mod:`.devices`), :mod:`.sim_clients` bench serve's closed-loop clients.
* :mod:`.predict`: a `specdec bench serve` run predicted from a profile, and put next to a measured one.
* :mod:`.planner` and :mod:`.plan_report`: the deployment search, its table, JSON and plots;
  :mod:`.ahead` runs its simulations ahead in processes.
"""
