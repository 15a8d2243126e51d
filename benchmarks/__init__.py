"""Benchmarks, probes and GPU measurements of fa_lib: not part of the installed package.

``python -m benchmarks --help`` (from the repository root) lists the sweeps; ``benchmarks.data`` holds their
committed JSON results, which the book reads; ``benchmarks/probes`` holds the probes whose data the book and
the code's rules cite (``python -m benchmarks.probes.probe_<name> --help``).
"""
