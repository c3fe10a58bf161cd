"""Measured attention timings per GPU class, and the auto-selection ranking computed from them.

`sm90-h100.json` and its siblings are produced from `sglx bench attention` reports by
`python -m sglx.attention.measured` (see docs/benchmarks.md); selection reads them through `record.py`
and ranks backends per phase in `ranking.py`. A GPU class without a record keeps SGLang's fixed order.
"""
