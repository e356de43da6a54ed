"""``python -m mlx_lm_streaming.synthetic OUT_DIR ...``"""

from . import main

main()
