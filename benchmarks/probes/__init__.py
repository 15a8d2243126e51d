"""Probes: experiments on one GPU whose questions are still open (``python -m benchmarks.probes.probe_<name>``).

* ``probe_decode_tail``, ``probe_decode_ws``: self-contained variants of the decoding split kernel (prefetching,
  warp specialization), timed against its read ceiling, for the one-sequence long-cache points below 0.8 of the
  copy bandwidth.
* ``probe_read_ceiling``: that ceiling: how fast a kernel that only reads the cache can go.
* ``probe_paged_decode``, ``probe_paged_prefill``: decoding and prefill over paged caches (page sizes, page order,
  blocks).
* ``probe_variants``: builds variants of fa_lib's kernels from its source, for the probes above.

A probe whose question was answered became a rule in fa_lib with a one-line reason and the measurement it rests
on (``benchmarks/data/probe-*.json``, which records the command that wrote it); its script then left the
repository (git keeps it).
"""
