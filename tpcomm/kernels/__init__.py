"""Triton kernels: sync primitives (``sync.py``), the shared epilogue (``epilogue.py``) and the
collectives (``one_shot.py``). Import this package only after ``TRITON_INTERPRET`` has its final value."""
