"""One training run of the hybrid LM (the base of every sweep); sized for 2 CPU cores.

The one home of every config key's default: the other configs start from this one, the code
indexes keys directly (``config.train.steps``), and a stored run's config that lacks a key
added since is completed from here (``experiments.configs.with_defaults``)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "run"
    c.seed = 0
    c.compile_cache = ""  # a folder for JAX's persistent compilation cache ("" = off)

    c.model = ml_collections.ConfigDict(dict(
        pattern="M-M*M-",  # Nemotron-H letters: M Mamba-2, * attention, - MLP, E MoE
        d_model=64, vocab=256, num_heads=4, mlp_mult=4, ssm_expand=2, ssm_head_dim=16,
        ssm_state=16, conv_width=4, mtp=False, mtp_tied_head=False, dtype="bfloat16",
        # "einsum", or "flash" (fp4lab.beyond.attention) with its P.V rounding and saved output
        attention="einsum", attention_accumulate="fp32", attention_saved="float32",
        # the Mamba-2 state: "" (parallel scan) or a stored format (experiments/model.py)
        ssm_state_format="", ssm_state_rounding="nearest",
        # the residual stream between blocks: "", "e4m3" or "e4m3_token"; gated writes
        residual_format="", residual_gate=False,
        # the MLP's squared ReLU recomputed from its input stored in a format ("" = off)
        mlp_saved="",
        # MoE blocks (E): experts, top-k, expert width (0: mlp_mult * d_model / top_k),
        # softmax | sigmoid scores, the router GEMM's dtype, the load-balancing loss's weight,
        # a shared expert, a LatentMoE width (0: off), DeepSeek-V3's bias-update rate for
        # auxiliary-loss-free balancing (0: off; DeepSeek-V3: 0.001), the format the
        # dispatched rows are sent in ("" = as they are; mxfp8 as torchao), expert
        # parallelism over the devices (all-to-all dispatch); experiments/model.py
        moe_experts=8, moe_top_k=2, moe_hidden=0, moe_router="softmax",
        moe_router_dtype="float32", moe_aux_loss=0.01, moe_shared=False, moe_latent=0,
        moe_bias_rate=0.0, moe_dispatch="", moe_parallel=False))

    c.data = ml_collections.ConfigDict(dict(
        paths=(),  # files/folders of text; () = the Python standard library's sources
        suffixes=(),  # in folders: () = every text file, or e.g. ('.txt', '.md') only
        seq_len=128, batch_size=8, val_fraction=0.1, val_batches=4,
        # token files instead of bytes (experiments/data.py, docs/experiments.md); None = off.
        # (None, not "": a run stored before these keys existed resumes without a change)
        tokens=None,  # a train .bin: nanoGPT (raw uint16) or llm.c (256-int32 header)
        val_tokens=None,  # None: beside it, the last "train" in the name -> "val"
        token_format=None,  # None/"auto" (from the llm.c magic), "nanogpt" or "llmc"
        vocab_size=None))  # None/0: tokenizer.json/meta.pkl beside it, else max id + 1

    c.train = ml_collections.ConfigDict(dict(
        steps=150, lr=3e-3, min_lr_ratio=0.1, warmup=15, schedule="cosine",  # or "wsd"
        decay_fraction=0.2,  # WSD: the final linear decay
        weight_decay=0.1, b1=0.9, b2=0.95, clip=1.0, mtp_weight=0.3,
        log_every=10, eval_every=0, ckpt_every=50,
        bf16_last_fraction=0.0,  # the late precision switch: last fraction of steps in BF16
        optimizer="adamw",  # or "muon" (experiments/optimizers.py)
        # TetraJet-v2's OsciReset (fp4lab.features.osci_reset) on the kernels whose forward weight
        # is in osci_reset.format; period 0 = off (the authors: 200, 50, 8, from step 8000)
        osci_reset=ml_collections.ConfigDict(dict(
            period=0, window=50, threshold=8.0, start=0, format="nvfp4_double")),
        # TetraJet-v2's OutControl (fp4lab.features.outcontrol), for layers whose recipe has it
        # (tetrajet_v2_outcontrol): input-channel norms summed over steps [start, start +
        # steps), the split from then on (the authors: 501 and 50 of 12505 steps)
        outcontrol=ml_collections.ConfigDict(dict(start=5, steps=5)),
        # "xla", or fp32 | bf16_wire | bf16_ring | bf16_tree spelled out per replica, with
        # per-parameter rules ((regex, mode), ...) (fp4lab.beyond.reduction)
        grad_reduce="xla", grad_reduce_rules=(),
        grad_survival=False,  # log how much of the MTP gradient survives (mtp_tied_head)
        # Muon's own settings (experiments/optimizers.py; ns_coeffs: a preset name or
        # coefficients; consistent_rms: a number or None; mu_dtype: None or a dtype name)
        muon=ml_collections.ConfigDict(dict(
            ns_steps=5, ns_coeffs="standard", beta=0.95, nesterov=True, consistent_rms=0.2,
            mu_dtype=None, split_qkv_heads=True, adam_lr_ratio=1.0), type_safe=False)))

    # backend: "auto" (Pallas kernels on a GPU), "xla" or "pallas" (fp4lab.numerics.backend)
    c.precision = ml_collections.ConfigDict(dict(policy="nemotron3", backend="auto"))
    c.probes = ml_collections.ConfigDict(dict(every=25, fused=True))
    return c
