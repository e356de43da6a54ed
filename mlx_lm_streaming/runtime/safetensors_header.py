"""The old path of ``reads.safetensors_header`` (plugin authors may import it): this module is that one."""

import sys

from .reads import safetensors_header

sys.modules[__name__] = safetensors_header
