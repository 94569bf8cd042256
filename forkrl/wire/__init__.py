"""The wire contract: Python code generated from proto/ by scripts/gen_protos.py (do not edit by hand).

The proto packages are `forkrl.rollout.v1` and `forkrl.trainer.v1` (those names are on the wire); the
generated modules live here so that nothing outside this package reads like a service."""
