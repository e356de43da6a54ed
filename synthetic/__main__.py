"""``python -m synthetic OUT_DIR ...``"""

from . import main

main()
