"""fp4lab experiments: a hybrid Mamba-Transformer LM on real text, training with numerics
probes, precision sweeps and automatic per-layer format assignment.

* ``model``: the hybrid LM (Flax Linen); ``data``: the byte-level corpus and its batches;
  ``configs``: the ml_collections configs and ``key=value`` overrides; ``policies``: the
  named precision policies;
* ``step``: the pure training parts (``TrainState``, optimizer, loss, jitted train and eval
  steps); ``records``: the files a run writes (one atomic writer, JSON Lines, TensorBoard);
  ``probes``: probe records and summaries, layer kinds and their order;
* ``train``: one run (setup, loop, checkpoints and resume, Ctrl-C, divergence, the CLI);
  ``sweep``: one run per policy and the reports; ``auto_assign``: a per-layer policy from
  short probe runs.

Library code (``fp4lab``) never imports this package; it is installed alongside so that
notebooks and scripts can ``import experiments``. Importing it registers the named policies
(``policies``) with ``fp4lab.policy.get_policy``, the one parser of policy strings, so every
``python -m experiments.<x>`` command, notebook and script reads them wherever a policy is
named (``quantize_model(model, "nvfp4_bf16_last2")`` too).
"""

from experiments import policies as _policies  # noqa: F401  (registers the policy names)
