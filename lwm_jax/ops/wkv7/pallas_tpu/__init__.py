"""WKV7 on TPU with Pallas-Mosaic: `op` (custom_vjp wiring, `wkv7_tpu`), `fwd` / `bwd` (the
`pallas_call`s), `tiles` (per-chunk tile math)."""
