"""Host views of MLX arrays: numpy arrays over an MLX array's own memory, where MLX memory has one.

Direct reads write an expert's bytes through these views into the bank's slots (reads/bank_reads.py), and on the
CPU backend staged experts are copied in through them; staging buffers are MLX arrays with such a view
where there is one (``staging_buffer``). Each view is checked once by a write that MLX must then see.
"""

import ctypes
from typing import Optional

import mlx.core as mx
import numpy as np

_HOST_VIEWS = None  # whether MLX arrays give writable host views here (checked once)


def staging_buffer(rows: int, nbytes: int):
    """``(mlx array or None, writable numpy array)`` of ``rows x nbytes`` bytes. The MLX array is
    made from host memory (``mx.array`` of zeros: MLX copies them into memory of its own, with no
    evaluation), not by ``mx.zeros``, whose evaluation waits on the stream behind the model's
    pending work (a staging buffer is made where a layer misses, mid-forward)."""
    global _HOST_VIEWS
    if _HOST_VIEWS is not False and rows * nbytes > 0:
        arr = mx.array(np.zeros((rows, nbytes), dtype=np.uint8))
        try:
            view = np.array(arr, copy=False)
            ok = view.flags.writeable and view.ctypes.data != 0 and view.shape == (rows, nbytes)
        except (TypeError, ValueError, RuntimeError):
            ok = False
        if ok and _HOST_VIEWS is None:
            # a write through the view must be what MLX sees
            view[0, :1] = 1
            ok = arr[0, 0].item() == 1
            view[0, :1] = 0
        _HOST_VIEWS = bool(ok)
        if ok:
            return arr, view
    return None, np.empty((rows, nbytes), dtype=np.uint8)


def host_bytes(arr: mx.array, address: Optional[int] = None) -> Optional[np.ndarray]:
    """A writable ``(rows, bytes per row)`` uint8 numpy view of an evaluated, row-contiguous MLX
    array's own memory, or None where MLX memory has no writable host view (checked by a write that
    MLX must then see).

    The view holds no reference to the MLX array (a held reference would stop MLX from updating the
    array in place, see ``reads.bank_reads.install``), so it is valid only while the array keeps this
    buffer: ``host_address`` tells whether it still does (``address``: its result, if known)."""
    if _HOST_VIEWS is False or arr.size == 0:
        return None
    if address is None:
        address = host_address(arr)
    if address is None:
        return None
    rows = arr.shape[0]
    raw = (ctypes.c_uint8 * arr.nbytes).from_address(address)
    view = np.ctypeslib.as_array(raw).reshape(rows, arr.nbytes // rows)
    # a write through the view must be what MLX reads (then put the byte back)
    old = int(view[0, 0])
    view[0, 0] = old ^ 0xFF
    seen = int(arr.reshape(-1)[:1].view(mx.uint8)[0].item()) if arr.dtype.size >= 1 else -1
    view[0, 0] = old
    if seen != old ^ 0xFF:
        return None
    return view


def host_address(arr: mx.array) -> Optional[int]:
    """Address of an evaluated, row-contiguous MLX array's memory, or None."""
    try:
        flat = arr if arr.dtype in _NUMPY_DTYPES else arr.view(mx.uint8)
        mx.eval(flat)
        view = np.array(flat, copy=False)
    except (TypeError, ValueError, RuntimeError):
        return None
    if not view.flags.c_contiguous or view.nbytes != arr.nbytes or view.ctypes.data == 0:
        return None
    return int(view.ctypes.data)


_NUMPY_DTYPES = (mx.uint8, mx.uint16, mx.uint32, mx.int8, mx.int32, mx.float16, mx.float32)
