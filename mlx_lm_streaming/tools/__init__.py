"""Commands and analyses around a run, outside its data path.

``budget_table`` and ``replay`` (``mlx_lm_streaming plan``: budgets side by side, a routing trace
replayed through the real slot tables), ``pack`` (``mlx_lm_streaming pack``), ``parity``
(``mlx_lm_streaming verify``: stock and streaming logits compared bit for bit). Nothing in the data
path imports a tool; the CLI (``__main__``) and the tests do.

May import: errors, option_table, runtime, files, integration
"""
