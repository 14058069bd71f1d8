"""Deployment: the ``specdec serve`` launcher (embedded or an existing Ray cluster), its YAML config,
a ``ray up`` cluster example (``cluster/aws.yaml``), and capacity planning
(:mod:`cluster.planning`: ``specdec profile``, the simulator, ``specdec plan``).

This package composes the three services (draft_worker, target_worker, router); it is the only one
allowed to import them all.
"""
