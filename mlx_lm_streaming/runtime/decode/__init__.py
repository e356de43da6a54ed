"""What one model call does at each MoE layer: ``modes`` (the mode of a call, chosen once),
``schedules`` (a per-layer call's schedule), ``switch`` (the drop-in ``SwitchGLU`` /
``SwitchMLP``), ``verified_step`` (a decode step with no host sync per layer),
``step_caches`` (the cache entries it puts back), ``share_limits`` (when a call is verified),
``checked_late`` (each token checked one token late) and ``runner`` (the decode call that
chooses among them).

May import: runtime, reads, bank
"""
