"""Plain-torch float64 references, shared by tests, benchmarks and the self-check."""

from .softmax import softmax_backward_ref, softmax_ref
