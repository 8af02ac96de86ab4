"""Ahead-of-time compilation for a target that is not attached: a TPU topology (or the devices
JAX sees), its per-chip memory plan and cost, and the compiled step saved for the pod to load.

`topology`: accelerator-type names -> the devices of a real TPU topology (libtpu, no TPU needed);
`plan`: compile a run config's train and eval steps for those devices and read XLA's memory and
cost analyses; `cli`: `lwm-jax compile`. The saved step's format lives with its reader, the
trainer (`lwm_jax.train.saved_step`); `testing`: helpers of the TPU compile tests.
"""
