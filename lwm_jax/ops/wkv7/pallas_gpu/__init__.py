"""WKV7 on GPU with Pallas-Triton: `op` (custom_vjp wiring, `wkv7_gpu`), `launches` (the
`pallas_call`s and their `Tuning`), `tiles` / `tiles_bwd_stacked` (per-chunk tile math), `pair`
(sequence parallelism's value and identity passes sharing one intra-chunk launch)."""
