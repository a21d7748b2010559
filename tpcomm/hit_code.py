"""A cached call's repeat as straight-line Python, written once per entry of the call cache.

Problem: a repeated call (:mod:`tpcomm.call_cache`) takes the same steps every time: read each
tensor's address, test the outputs the caller passed against the inputs for shared bytes, allocate the
new outputs, compare each address's 16-byte residue with the recording's (on CUDA Triton specialises
pointers on it), then launch the recorded kernels with the addresses in their parameter slots. Done by
loops over tables of slots, these steps cost about as much Python as the kernel launch itself.

Mechanism: when a call is recorded, :func:`compile_hit` writes those steps for that entry as the source
of one function and compiles it (as Triton writes a binder per kernel): each address a local variable
read once, each overlap test one comparison with the sizes as constants, each parameter store one
assignment. The function returns the call's result, or None before launching anything where the full
path must decide (a given output shares bytes with an input or another output, another alignment, a CPU
scale that is not finite and positive): the full path then raises or runs the call as a first call would.

Invariant: a repeat does what the full path would do with the same tensors. Under the communicator's
lock it raises on a closed communicator and on a recorded error (before and after its launches), and on
CUDA orders the current stream after the previous call's, as every call does. A replay launches through
the compiled kernel's launcher when it is direct, Triton's launch hooks run nothing and the recording
device is current (:meth:`tpcomm.kernels.launch.Replay.launch`'s rule), through ``Replay.launch``
otherwise. A direct replay's launcher, function, metadata and parameter list are constants of the code
(the module's own launch where :func:`~tpcomm.kernels.launch.raw_launch` finds one): after
:meth:`~tpcomm.kernels.launch.Replay.bind_launcher`, :meth:`tpcomm.call_cache.CachedCall.rebuild` writes
the code again.
"""

from __future__ import annotations

import dataclasses

import torch

#: An output whose layout is the input ``x``'s (the call's first tensor): ``torch.empty_like`` of it.
LIKE_X = "like x"


@dataclasses.dataclass(frozen=True)
class HitSpec:
    """What a repeat of one recorded call does, slot by slot. The slots are the call's tensors in the order
    the replays' slots (:class:`~tpcomm.kernels.launch.Replay`) number them.

    Attributes:
        op: the op's name (in errors).
        args: the hit function's parameters after the communicator, e.g. ``("x", "out")``.
        sources: per slot, where its tensor comes from: ``("arg", name)`` the caller's argument,
            ``("new", layout)`` a new tensor (``LIKE_X`` or ``(shape, strides, dtype, device)``),
            ``("zeros", layout)`` a new zero-filled one, ``("same", k)`` slot ``k``'s tensor, or None (no
            tensor).
        given: slots of outputs the caller passed: each may share no byte with an input or another given
            output.
        inputs: slots the kernels read.
        in_place: ``(output, input)`` slot pairs that may be the very same memory (an output updated in
            place).
        result: the slots returned, in order (None: a None in the result).
        single: return ``result[0]`` itself rather than a tuple.
        positive_scale: the slot of a CPU scale that must be finite and positive (read on the host, as the
            full path reads it), or None.
        static_scale: that scale is a static FP8 one, whose float32 reciprocal must be finite too.
    """

    op: str
    args: tuple
    sources: tuple
    given: tuple = ()
    inputs: tuple = ()
    in_place: tuple = ()
    result: tuple = ()
    single: bool = False
    positive_scale: int | None = None
    static_scale: bool = False


#: Triton's launch hooks run nothing (:func:`tpcomm.kernels.launch._idle` of both, inline): None, or a
#: hook chain without calls.
_IDLE_HOOKS = ("((e := HOOKS.launch_enter_hook) is None or e.__class__ is HC and not e.calls) and "
               "((e := HOOKS.launch_exit_hook) is None or e.__class__ is HC and not e.calls)")


def _raw_stream():
    return getattr(torch._C, "_cuda_getCurrentRawStream", None)


def compile_hit(spec: HitSpec, replays: tuple, nbytes: tuple, residues: tuple | None, lock, err,
                device_index: int | None):
    """The repeat of one recorded call: ``(hit, source)``, ``hit(comm, *spec.args)`` the function and
    ``source`` its text.

    Args:
        spec: the call's slots and result.
        replays: its :class:`~tpcomm.kernels.launch.Replay` launches, in order.
        nbytes: each slot's size in bytes in the recording call (fixed by the key; 0: no tensor).
        residues: on CUDA, each slot's address modulo 16 in the recording call (the pattern Triton
            specialised the kernels on); None off CUDA (no test, no stream).
        lock: the communicator's lock; ``err``: its error words (``Workspace._err_words``).
        device_index: the CUDA device the launches were recorded on (None off CUDA).
    """
    consts = {"LOCK": lock, "ERR": memoryview(err), "OP": spec.op, "INF": float("inf"), "EMPTY_LIKE": torch.empty_like,
              "EMPTY_STRIDED": torch.empty_strided, "ZEROS": torch.zeros, "IDX": device_index,
              "CUR": getattr(torch._C, "_cuda_getDevice", lambda: None), "RAW": _raw_stream()}
    try:
        from triton import knobs

        consts["HOOKS"] = knobs.runtime
    except ImportError:  # a Triton without knobs has no direct replays (Replay.bind_launcher needs them)
        consts["HOOKS"] = None
    try:
        from triton.knobs import HookChain
    except ImportError:  # Triton before 3.5: a hook is None or a function
        HookChain = None
    consts["HC"] = HookChain
    n = len(spec.sources)
    t: list = [None] * n  # each slot's tensor, as an expression of the generated code
    p: list = [None] * n  # its address
    code = [f"def hit(comm, {', '.join(spec.args)}):"]
    for j, src in enumerate(spec.sources):
        if src is not None and src[0] == "arg":
            t[j] = src[1]
    if spec.positive_scale is not None:
        scale = t[spec.positive_scale]
        test = f"not 0.0 < float({scale}.reshape(())) < INF"
        if spec.static_scale:  # as the full path: a float32 reciprocal that overflows is refused
            consts["RECIPROCAL_INF"] = lambda v: bool(torch.isinf(torch.reciprocal(v.detach().reshape(()))))
            test += f" or RECIPROCAL_INF({scale})"
        code.append(f"    if {test}:")
        code.append("        return None")
    for j in range(n):
        if t[j] is not None:
            code.append(f"    p{j} = {t[j]}.data_ptr()")
            p[j] = f"p{j}"
    tests = []
    given = [k for k in spec.given if nbytes[k]]
    for i, k in enumerate(given):
        for j in [j for j in spec.inputs if nbytes[j] and t[j] is not None] + given[i + 1:]:
            test = f"p{k} < p{j} + {nbytes[j]} and p{j} < p{k} + {nbytes[k]}"
            if (k, j) in spec.in_place:
                test += f" and p{k} != p{j}"
            tests.append(f"({test})")
    if tests:
        code.append("    if " + " or ".join(tests) + ":")
        code.append("        return None")
    for j, src in enumerate(spec.sources):
        if src is None or src[0] not in ("new", "zeros"):
            continue
        kind, layout = src
        if kind == "new" and layout == LIKE_X:
            code.append(f"    t{j} = EMPTY_LIKE({t[0]})")
        else:
            shape, strides, dtype, device = layout
            consts.update({f"S{j}": shape, f"ST{j}": strides, f"D{j}": dtype, f"V{j}": device})
            code.append(f"    t{j} = EMPTY_STRIDED(S{j}, ST{j}, dtype=D{j}, device=V{j})" if kind == "new"
                        else f"    t{j} = ZEROS(S{j}, dtype=D{j}, device=V{j})")
        t[j], p[j] = f"t{j}", f"p{j}"
        code.append(f"    p{j} = t{j}.data_ptr()")
    for j, src in enumerate(spec.sources):
        if src is not None and src[0] == "same":
            t[j], p[j] = t[src[1]], p[src[1]]
    if residues is not None:
        present = [j for j in range(n) if p[j] is not None and spec.sources[j][0] != "same"]
        if all(residues[j] == 0 for j in present):
            code.append(f"    if ({' | '.join(p[j] for j in present)}) & 15:")
        else:
            code.append("    if " + " or ".join(f"({p[j]} & 15) != {residues[j]}" for j in present) + ":")
        code.append("        return None")
    code.append("    with LOCK:")
    code.append("        if comm._closed:")
    code.append("            comm._check_open(OP)")
    code.append("        if ERR[0]:")
    code.append("            comm.check(OP)")
    if residues is not None and consts["RAW"] is not None:
        code.append("        stream = RAW(IDX)")
        code.append("        last = comm._last_stream")
        code.append("        if last is None or last[0] != stream:")
        code.append("            comm._order_streams()")
    else:
        code.append("        stream = None")
    tensors = "(" + ", ".join(t[j] or "None" for j in range(n)) + ",)"
    ptrs = "(" + ", ".join(p[j] or "0" for j in range(n)) + ",)"
    if len(replays) > 1 and any(r.direct for r in replays):
        code.append(f"        direct = {_IDLE_HOOKS} and CUR() == IDX")
    for i, replay in enumerate(replays):
        consts[f"R{i}"], consts[f"G{i}"] = replay, replay.grid
        if not replay.direct:
            code.append(f"        R{i}.launch({tensors}, stream, {ptrs})")
            continue
        consts.update({f"P{i}": replay._params, f"F{i}": replay._function, f"M{i}": replay._meta})
        code.append("        if direct:" if len(replays) > 1 else f"        if {_IDLE_HOOKS} and CUR() == IDX:")
        for param, slot in replay.slots:
            code.append(f"            P{i}[{param}] = {p[slot]}")
        if replay._raw is not None:  # the module's own launch: flags and scratch pointers before the metadata
            consts[f"RUN{i}"], consts[f"COOP{i}"], consts[f"PDL{i}"] = replay._raw
            code.append(f"            RUN{i}(G{i}, 1, 1, stream, F{i}, COOP{i}, PDL{i}, None, None, M{i}, None, None, "
                        f"None, *P{i})")
        else:
            consts[f"RUN{i}"] = replay._run
            code.append(f"            RUN{i}(G{i}, 1, 1, stream, F{i}, M{i}, None, None, None, *P{i})")
        code.append("        else:")
        code.append(f"            R{i}.launch({tensors}, stream, {ptrs})")
    code.append("        if ERR[0]:")
    code.append("            comm.check(OP)")
    names = [t[j] if j is not None and t[j] is not None else "None" for j in spec.result]
    code.append(f"    return {names[0]}" if spec.single else f"    return {', '.join(names)}")
    source = "\n".join(code) + "\n"
    namespace = dict(consts)
    exec(compile(source, f"<tpcomm repeat of {spec.op}>", "exec"), namespace)
    # taken out of its own globals: left there, function and namespace form a cycle that keeps the
    # recorded launches, and through them the workspace, alive after close() until the cyclic GC runs
    return namespace.pop("hit"), source
