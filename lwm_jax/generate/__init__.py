"""Text generation: RWKV-7 in RNN mode (O(1) per token) or a LLaMA-style model on a KV cache,
sampling, state save/load (RWKV-7).

    gen = Generator(model)                       # compiles prefill + decode block once; reuse it
    result = gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=50,
                          sampling=SamplingParams(temperature=0.8, top_p=0.9),
                          stop_tokens=[0])
    for row, token in gen.stream([ids]): ...     # streaming
    save_state("sys.safetensors", gen.prefill_state([system_ids]), model.cfg)
"""
from lwm_jax.generate.cli import add_generate_args, generate_main
from lwm_jax.generate.engine import GenerationResult, Generator, generate
from lwm_jax.generate.sampling import SamplingParams, apply_penalties, filter_logits, sample
from lwm_jax.generate.state_io import load_state, save_state

__all__ = ["Generator", "GenerationResult", "generate", "SamplingParams", "apply_penalties",
           "filter_logits", "sample", "save_state", "load_state", "add_generate_args",
           "generate_main"]
