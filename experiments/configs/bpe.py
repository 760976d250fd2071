"""The headline policies on BPE tokens instead of bytes: a 4096-token byte-level BPE trained
on the standard library's sources (``python -m experiments.tokenize``), so the embedding and
the output head have realistic shapes (64 x 4096: the head is most of the parameters, where
NVFP4's head numerics matter); three seeds (about 12 minutes on 2 CPU cores).

    python -m experiments.tokenize --vocab-size 4096
    python -m experiments.sweep --config bpe --out results/bpe
"""

from experiments.configs import sweep_section
from experiments.configs.default import get_config as _default


def get_config():
    c = _default()
    c.data.tokens = "results/tokens/stdlib-bpe4096/train.bin"
    c.sweep = sweep_section(("bf16", "nvfp4", "nemotron3"), seeds=3)
    return c
