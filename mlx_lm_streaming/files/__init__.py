"""The files a run writes and reads besides the checkpoint, and the rules they follow.

``packfile`` (the expert pack: format, reader, writer; ``pack_target``: where ``--out`` puts it),
``routing_trace`` (which experts each layer picked, ``--record-routing``), ``timeline`` (trace-event
JSON, ``--streaming-trace``), ``outputs`` (what every output file obeys: its magic, the lock beside
it, replaced whole or not at all).

Below integration/ (loading opens the recorders), stores/ (the pack store reads packs) and tools/;
above runtime/ (a pack names tensors by the checkpoint's index).

May import: errors, runtime
"""
