"""The lone-sequence fast path: a persistent decode kernel and decode bursts in CUDA graphs.

The runner asks it once per step, through `seam.FastPath.take` (seam.py documents the whole
interface); everything else here is behind that seam: the kernel (kernel.py, its stages in
stages.py, attention.py and head.py, shared helpers in common.py, inline PTX in ptx.py, the
int8 LM head in head_quant.py, a top-k sample from its bounds in head_refine.py), its host
side (decoder.py) and its CUDA graphs (graphs.py).
"""
