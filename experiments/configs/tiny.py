"""A seconds-long run for tests and smoke checks."""

from experiments.configs.default import get_config as _default


def get_config():
    c = _default()
    c.name = "tiny"
    c.model.pattern = "M*-"
    c.model.d_model = 32
    c.model.num_heads = 2
    c.model.ssm_state = 8
    c.data.seq_len = 32
    c.data.batch_size = 8
    c.data.val_batches = 2
    c.train.steps = 12
    c.train.warmup = 2
    c.train.log_every = 4
    c.train.ckpt_every = 6
    c.probes.every = 6
    return c
