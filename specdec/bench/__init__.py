"""Benchmarks: `specdec bench runner | generate | serve` (the engine and the service, measured)."""
