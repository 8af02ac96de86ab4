"""Text generation: RWKV-7 in RNN mode (O(1) per token) or a LLaMA-style model on a KV cache,
sampling, state save/load (RWKV-7: the state and the logits of its last position, so a loaded
state continues with or without new text).

    gen = Generator(model)                       # compiles prefill + decode block once; reuse it
    result = gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=50,
                          sampling=SamplingParams(temperature=0.8, top_p=0.9),
                          stop_tokens=[0])
    for row, token in gen.stream([ids]): ...     # streaming
    res = gen.generate([system_ids], max_new_tokens=0)          # the prompt's state
    save_state("sys.safetensors", res.state, model.cfg, logits=res.last_logits)
    saved = load_state_file("sys.safetensors", model.cfg)
    gen.generate([[]], 50, initial_state=saved.state, initial_logits=saved.logits)  # no new text
"""
from lwm_jax.generate.cli import generate_main
from lwm_jax.generate.engine import GenerationResult, Generator, generate
from lwm_jax.generate.sampling import SamplingParams, apply_penalties, filter_logits, sample
from lwm_jax.generate.state_io import SavedState, load_state, load_state_file, save_state

__all__ = ["Generator", "GenerationResult", "generate", "SamplingParams", "apply_penalties",
           "filter_logits", "sample", "save_state", "load_state", "load_state_file", "SavedState",
           "generate_main"]
