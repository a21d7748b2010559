"""Triton kernels: sync primitives (``sync.py``), the shared epilogue (``epilogue.py``) and the
collectives (``one_shot.py``). Import this package only after ``TRITON_INTERPRET`` has its final value."""

from ..env import interpreter_enabled as _interpreter_enabled

if _interpreter_enabled():
    from .interpreted import install as _install

    _install()  # device-function calls inside an interpreted launch patch nothing again (interpreted.py)
