"""Long prompts, layer-major: ``layer_major`` (the prefill: chunks recorded, then one decoder
layer over many chunks), ``layer_pass`` (one layer's pass, its MoE calls answered
expert-major, in waves through the slots) and ``set_pass`` (one layer's every expert in one
set).

May import: runtime, reads, bank, decode, memory
"""
