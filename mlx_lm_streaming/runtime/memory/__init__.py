"""The memory a streaming model uses: ``expert_cache`` (the byte budget over every bank),
``tuning`` and ``moving_budget`` (the budget as free memory moves), ``free_memory`` and
``machine`` (this machine's RAM, swap and GPU memory), on mlx-cuda ``tiers`` (every expert
across device and host memory, placed by ``cuda_placer``) or ``host_cache`` (host slots
between the banks and disk), ``report`` (what a run says of them), and ``queue_worker`` (the
one background thread each of the fill and the tiers' moves keep).

May import: runtime, reads, bank, decode
"""
