"""One module per op: each op's host path (argument checks, outputs, plan, launch, fallback), which the
:class:`~tpcomm.Communicator`'s method of the same name hands its call to."""
