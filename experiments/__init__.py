"""fp4lab experiments: a hybrid Mamba-Transformer LM on real text, training with numerics
probes, precision sweeps and automatic per-layer format assignment.

Library code (``fp4lab``) never imports this package; it is installed alongside so that
notebooks and scripts can ``import experiments``.
"""
