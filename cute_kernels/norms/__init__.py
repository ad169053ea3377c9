"""Row-wise kernels: softmax (and, later, norms and losses)."""
