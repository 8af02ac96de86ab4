"""Training: typed run config, RWKV-LM optimizer groups, loss, mesh/sharding, checkpoints,
metrics and the trainer loop behind `lwm-jax train`.

    from lwm_jax.train import load_config, train
    result = train(load_config("configs/tiny.yaml", ["train.steps=50"]))
"""
from lwm_jax.train.config import RunConfig, load_config
from lwm_jax.train.trainer import TrainResult, train

__all__ = ["RunConfig", "load_config", "train", "TrainResult"]
