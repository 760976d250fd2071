"""fp4lab experiments: a hybrid Mamba-Transformer LM on real text, training with numerics
probes, precision sweeps, automatic per-layer format assignment, analyses of trained runs
and the engines that serve them. One meaning per module:

* the model and its data: ``model`` (the hybrid LM, Flax Linen), ``data`` and ``tokenize``
  (byte-level corpus, BPE token files), ``configs`` (ml_collections configs, ``key=value``
  overrides), ``policies`` (the named precision policies), ``optimizers``;
* one run: ``run_spec`` (a config checked once, a frozen ``RunSpec``), ``memory`` (will it
  fit), ``setup`` (model, state and the stateful features), ``step`` (the pure, jitted train
  and eval steps), ``loop``, ``checkpoints``, ``records`` and ``run_files`` (what a run
  writes and reads back), ``probe_records`` (probe tables, layer kinds), ``processes``
  (multi-process runs), ``runinfo`` (what it ran on), ``train`` (the command);
* many runs: ``sweep`` (one run per policy and seed, the reports), ``stats`` (intervals),
  ``tables`` (report cells), ``auto_assign`` (a per-layer policy from short probe runs);
* trained runs: ``runs`` (loaded back), ``rollout``, ``residual``, ``ssm_state``
  (precision beyond the GEMMs);
* serving: ``export`` (a run as each engine's layout, one row per layout), ``engines``
  (llama.cpp's ``nemotron_h``), ``hf_nemotron_h`` (transformers' ``NemotronHForCausalLM``),
  ``serve`` (generation with llama.cpp);
* ``commands``: what every ``python -m experiments.<x>`` does with a user's mistake.

Library code (``fp4lab``) never imports this package; it is installed alongside so that
notebooks and scripts can ``import experiments``. Importing it registers the named policies
(``policies``) with ``fp4lab.policy.get_policy``, the one parser of policy strings, so every
``python -m experiments.<x>`` command, notebook and script reads them wherever a policy is
named (``quantize_model(model, "nvfp4_bf16_last2")`` too).
"""

from experiments import policies as _policies  # noqa: F401  (registers the policy names)
