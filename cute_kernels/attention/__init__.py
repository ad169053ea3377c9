"""FlashAttention-2 on Hopper: ``flash_attn`` and ``flash_attn_varlen`` (``op.py``), the forward
kernel (``fwd_sm90.py``), its device pieces (``softmax.py``, ``mask.py``, ``fragments.py``) and
the tile heuristics (``config.py``)."""
