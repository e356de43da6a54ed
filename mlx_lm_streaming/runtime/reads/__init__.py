"""Where each expert's bytes are and how they get into memory: ``safetensors_header`` (one file's
header), ``index`` (every expert's tensors: file, offset, length), ``prefetch`` (the read pool
and staging buffers), ``host_views`` (numpy views of MLX memory the reads write through),
``bank_reads`` (a bank's reads: direct into slots, or staged) and ``lookahead`` (the next
layer's experts guessed and read ahead).

May import: runtime
"""
