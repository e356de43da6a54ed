"""The data path at run time: an expert's bytes from the checkpoint into a slot bank, and the MoE
layer call that computes with them. A room per part, bottom to top; a room imports only the plumbing
here and the rooms below it (tests/test_wings.py, ROOMS):

    prefill/   long prompts, layer-major
    memory/    the expert cache, its budget, tiers, host slots, the machine; the run's report
    decode/    a model call's mode, the layer call's schedules, the verified step, the drop-in switch
    bank/      a layer's slot bank and its writes
    reads/     the checkpoint's layout, the read pool, lookahead
    (here)     the plumbing every room uses: ``options`` (what was asked; ``variables``, the
               environment's names that look like ours and are not), ``policy`` (slot tables, eviction:
               ``options`` names its policies), ``mlx_compat`` and ``mlx_shims``
               (mlx-lm's internals behind the version guard), ``sizes`` (how every line writes a
               size), ``counters``, ``no_timeline``, ``devices``;
               ``safetensors_header``, ``index``: the old paths of reads/'s modules, kept for plugins

The plugin-facing ``stores/`` and ``kernels/`` stay at the package's top (their paths are what plugin
authors import); they import this wing, not the other way round.

May import: errors, option_table
"""
