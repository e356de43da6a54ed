"""The old path of ``reads.index`` (plugin authors may import it): this module is that one."""

import sys

from .reads import index

sys.modules[__name__] = index
