"""Losses built from several kernel families (composites over gemm/ and rowwise/)."""
