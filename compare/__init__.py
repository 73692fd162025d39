"""Measurement harnesses of titan-megamoe: every performance claim of the project comes from here.

* ``python -m compare.layer``: one MoE layer, stock TorchTitan vs megamoe, fwd / bwd / fwd+bwd.
* ``python -m compare.regress``: new records vs a baseline file; non-zero exit on regression.
* ``python -m compare.loss_spread``: run-to-run spread of the final training loss over several
  compare.train records, per config, against a reference config.
* ``python -m compare.capture_routing``: top-k expert ids of a real model, for ``replay:`` routing.

Importing ``compare`` does no work (no CUDA initialization, no process group).
"""
