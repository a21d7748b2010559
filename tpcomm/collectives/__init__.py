"""One module per op: the host path of each collective (checks, outputs, plan, launches, fallback), as
a function taking the :class:`~tpcomm.Communicator`, which holds the shared state and hands each call
to its module."""
