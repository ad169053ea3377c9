"""Row-wise kernels over one row machinery (tiling, loads, reductions, cluster exchange):
softmax, RMSNorm, LayerNorm and cross-entropy."""
