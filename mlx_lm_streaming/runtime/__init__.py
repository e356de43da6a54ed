"""The data path at run time: an expert's bytes from the checkpoint into a slot bank, and the MoE
layer call that computes with them.

- the checkpoint's layout: ``safetensors_header`` (one file's header), ``index`` (where each expert's
  bytes are);
- the cache: ``policy`` (slot tables, eviction), ``bank`` (a layer's slot bank and its writes),
  ``expert_cache`` (the byte budget over all banks), ``prefetch`` and ``lookahead`` (reads ahead),
  ``host_views`` and ``cuda_copy`` (the ways into slot memory), ``counters``; on mlx-cuda
  ``tiers`` (every expert across device and host memory, placed by ``cuda_placer``; a long prompt's
  calls over a device copy of their bank, ``device_copy``) or below that
  ``host_cache`` (host slots between the banks and disk);
- the layer call: ``switch`` (the drop-in ``SwitchGLU`` / ``SwitchMLP``), ``schedules``,
  ``verified_step`` (and ``step_caches``, the cache entries it puts back), ``layer_major`` (the
  prefill);
- what that path itself reads, so it sits here and not above: ``options`` (what was asked;
  ``expert_cache`` reads its sizes, and it names ``policy``'s policies; ``variables``, the
  environment's names that look like ours and are not), ``mlx_compat`` (mlx-lm's
  internals behind the version guard; the schedules and the verified step call its shims),
  ``memory`` and ``devices`` (the machine), ``report`` (what a run says; ``layer_major`` says its
  fallback through it) and ``sizes`` (how every line writes a size).

The plugin-facing ``stores/`` and ``kernels/`` stay at the package's top (their paths are what plugin
authors import); they import this wing, not the other way round.

May import: errors, option_table
"""
