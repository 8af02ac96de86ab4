"""Cloud TPU runs of `lwm-jax train`: small commands over `gcloud compute tpus`.

    python -m tpu_scripts create  TPU --accelerator-type v4-32 [--spot] [--queued]
    python -m tpu_scripts setup   TPU [--data gs://BUCKET/data/train]
    python -m tpu_scripts launch  TPU --config configs/tpu/v4-32-rwkv7-1.5b.yaml \
                                      --set checkpoint.dir=gs://BUCKET/runs/rwkv7-1.5b \
                                      [--accelerator-type v4-32 --compiled step.bin]
    python -m tpu_scripts status  TPU [--job JOB]
    python -m tpu_scripts logs    TPU --job JOB [--worker all] [--metrics]
    python -m tpu_scripts stop    TPU --job JOB
    python -m tpu_scripts delete  TPU
    python -m tpu_scripts babysit TPU --accelerator-type v4-32 --spot --config ... --set ...

Every command takes --project, --zone, --queued and --dry-run (print the commands, run
nothing). Modules: `cli` (arguments), `commands` (the steps of each command), `babysit` (the
poll-and-recover loop), `gcloud` (gcloud argument lists), `remote` + `worker.sh` (what runs on
the workers), `slices` (accelerator types), `checks` (the run config, checked before launch),
`flags` + `libtpu_flags.txt` (LIBTPU_INIT_ARGS), `source` (what setup ships), `runner` (run or
print). Nothing here imports JAX except `checks`, which loads the run config with lwm_jax.
Walk-through: docs/tpu.md.
"""
