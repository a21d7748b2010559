"""Block-uniform synchronisation, checked in a kernel's PTX (no GPU needed).

The invariant (docs/design.md, "Every wait decides as one block"): a branch that decides on a per-thread
value controls no barrier and no single-thread store. Triton lowers a scalar atomic, a scalar store and
the broadcast of a scalar through shared memory to one elected thread (``@%p st``, ``%p`` from
``%tid == 0``) and a ``bar.sync`` that every thread of the program must reach the same number of times. A
wait loop whose exit a thread decides alone (its own loads, its own clock, a reduction that stays inside
its warp) may therefore hold neither: the program's warps would leave it after different rounds and pair
their barriers wrongly, or the elected thread would skip the store another warp decided to make. A wait
loop that holds either must exit on a value that came through shared memory (a block-wide reduction),
the same in every thread.

Mechanism: a divergence analysis of the PTX of one ``.entry``. A register is *varying* (it may differ
between threads of one program by timing) when it comes from a poll (a volatile or memory-ordered load),
an atomic or a clock read (``%globaltimer``, ``%clock``), or from a varying operand, or when it is written
in a block that a varying branch controls (a thread that skipped the block keeps the old value). A value
computed from a thread's position (``%tid``) and data every thread sees alike is not varying: Triton's
reductions and layout conversions shuffle such values and end with the same result in every thread; the
position only picks the elected thread (``setp.eq`` of a ``%tid``-derived value with 0). A load from
shared memory is taken as uniform: Triton's block-wide reductions and broadcasts end in one (every warp
reads what every warp stored, after a barrier). The blocks a conditional branch
controls are those reachable from its successors before its immediate post-dominator. Inline asm is
analysed as the PTX it is (its scoped labels and registers resolved per ``{ }`` block).

Limits: the shared-memory rule trusts Triton's lowering (a layout conversion through shared memory would
also count as uniform); a loop exit the analysis cannot see through (an indirect branch) is not handled
(Triton emits none).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: Special registers that hold a thread's position (an elected thread is picked by comparing them).
POSITION_SPECIALS = ("%tid", "%laneid", "%warpid")
#: Opcodes (first dotted word) that write no register.
NO_DEST = {"st", "red", "bar", "barrier", "bra", "ret", "exit", "fence", "membar", "prefetch", "prefetchu",
           "griddepcontrol", "trap", "discard", "stmatrix", "setmaxnreg", "nanosleep", "pmevent", "brkpt",
           "call", "cp", "multimem", "tensormap", "applypriority", "createpolicy"}
#: Opcodes whose effect is on memory: under a varying branch, with an elected guard, the store is lost
#: for the warps that took the other way.
STORES = {"st", "red", "atom"}
#: Barriers every thread of a program must reach the same number of times.
BARRIERS = ("bar.sync", "bar.red", "bar.arrive", "barrier.sync", "barrier.red", "barrier.arrive", "bar.warp.sync")

_REG = re.compile(r"%[A-Za-z_][\w$]*(?:\.[xyz])?")
_LABEL = re.compile(r"^([$A-Za-z_][\w$]*)\s*:")
_DECL = re.compile(r"^\.reg\s+\.\w+\s+(.*)$", re.S)


@dataclass
class Instr:
    """One PTX statement: ``guard`` (register, negated), the opcode and the dest / source registers, each
    register resolved to its declaring scope."""
    line: int
    text: str
    opcode: str
    guard: str | None
    dests: list[str]
    srcs: list[str]
    target: str | None = None  # a branch's resolved label


@dataclass
class Block:
    name: str
    instrs: list[Instr] = field(default_factory=list)
    succs: list[str] = field(default_factory=list)


@dataclass
class Violation:
    kind: str  # "barrier" or "elected store"
    line: int
    text: str
    branch_line: int
    branch_text: str

    def __str__(self):
        return (f"line {self.line}: {self.kind} `{self.text}` under a branch on a per-thread value "
                f"(line {self.branch_line}: `{self.branch_text}`)")


def _strip(ptx: str) -> list[tuple[int, str]]:
    """The lines of the first ``.entry``'s body, comments and ``.loc``/``.file`` directives removed."""
    lines = ptx.splitlines()
    start = next(i for i, l in enumerate(lines) if ".entry" in l)
    out = []
    for i in range(start, len(lines)):
        text = lines[i].split("//", 1)[0].strip()
        if not text or text.startswith((".loc", ".file")):
            continue
        out.append((i + 1, text))
    return out


def _statements(lines: list[tuple[int, str]]):
    """``(kind, line, text, scope path)`` for each scope brace, label and statement of the body."""
    # skip the parameter list: the body starts at the first "{" after the closing ")" of the header
    depth_paren = 0
    buf = " ".join(t for _, t in lines)
    flat = [ln for ln, t in lines for _ in t + " "]  # the source line of each character of buf
    pos = 0
    while pos < len(buf):
        ch = buf[pos]
        if ch == "(":
            depth_paren += 1
        elif ch == ")":
            depth_paren -= 1
        elif ch == "{" and depth_paren == 0:
            break
        pos += 1
    scopes, counter, stmt, stmt_line = [], 0, "", 0
    while pos < len(buf):
        ch = buf[pos]
        if not stmt.strip():
            stmt = ""
            m = _LABEL.match(buf[pos:])
            if ch in " \t":
                pos += 1
                continue
            if ch == "{":
                counter += 1
                scopes.append(counter)
                yield ("open", flat[pos], "{", tuple(scopes))
                pos += 1
                continue
            if ch == "}":
                yield ("close", flat[pos], "}", tuple(scopes))
                scopes.pop()
                pos += 1
                if not scopes:
                    return
                continue
            if m and not buf[pos:].startswith("%"):
                yield ("label", flat[pos], m.group(1), tuple(scopes))
                pos += m.end()
                continue
            stmt_line = flat[pos]
        if ch == ";":
            yield ("stmt", stmt_line, stmt.strip(), tuple(scopes))
            stmt = ""
        else:
            stmt += ch
        pos += 1


def _split_operands(s: str) -> list[str]:
    ops, depth, cur = [], 0, ""
    for ch in s:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            ops.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        ops.append(cur.strip())
    return ops


class Kernel:
    """The control-flow graph of one kernel's PTX (:func:`parse`)."""

    def __init__(self, ptx: str):
        self.blocks: dict[str, Block] = {}
        self.order: list[str] = []
        self._parse(ptx)

    def _parse(self, ptx: str):
        decls: dict[tuple, set] = {}  # scope path -> register names declared there
        labels: dict[tuple, dict] = {}  # scope path -> {label: unique name}
        stmts = list(_statements(_strip(ptx)))
        # pass 1: declarations and labels per scope
        for kind, _, text, scope in stmts:
            if kind == "label":
                labels.setdefault(scope, {})[text] = f"{text}@{scope[-1]}"
            elif kind == "stmt" and text.startswith(".reg"):
                m = _DECL.match(text)
                names = set()
                for part in m.group(1).split(","):
                    part = part.strip()
                    n = re.match(r"(%[\w$]+)<(\d+)>", part)
                    if n:
                        names.update(f"{n.group(1)}{k}" for k in range(int(n.group(2))))
                    else:
                        names.add(part)
                decls.setdefault(scope, set()).update(names)

        def resolve(reg, scope):
            for k in range(len(scope), 0, -1):
                s = scope[:k]
                if reg in decls.get(s, ()):
                    return reg if k == 1 else f"{reg}@{s[-1]}"
            return reg

        def resolve_label(name, scope):
            for k in range(len(scope), 0, -1):
                if name in labels.get(scope[:k], {}):
                    return labels[scope[:k]][name]
            raise ValueError(f"ptx_sync: branch to unknown label {name}")

        current = self._new_block("entry")
        for kind, line, text, scope in stmts:
            if kind == "label":
                nxt = self._new_block(labels[scope][text])
                if not current.instrs or current.instrs[-1].opcode.split(".")[0] not in ("bra", "ret", "exit") \
                        or current.instrs[-1].guard:
                    current.succs.append(nxt.name)
                current = nxt
                continue
            if kind != "stmt" or text.startswith("."):
                continue
            ins = self._instr(line, text, scope, resolve, resolve_label)
            current.instrs.append(ins)
            base = ins.opcode.split(".")[0]
            if base == "bra":
                current.succs.append(ins.target)
                fall = self._new_block(f"after{line}@{len(self.order)}")
                if ins.guard:
                    current.succs.append(fall.name)
                current = fall
            elif base in ("ret", "exit") and not ins.guard:
                current = self._new_block(f"after{line}@{len(self.order)}")

    def _new_block(self, name: str) -> Block:
        b = Block(name)
        self.blocks[name] = b
        self.order.append(name)
        return b

    def _instr(self, line, text, scope, resolve, resolve_label) -> Instr:
        guard = None
        m = re.match(r"^@(!?)(%[\w$]+)\s+(.*)$", text, re.S)
        if m:
            guard = resolve(m.group(2), scope)
            text_body = m.group(3)
        else:
            text_body = text
        parts = text_body.split(None, 1)
        opcode, rest = parts[0], (parts[1] if len(parts) > 1 else "")
        ops = _split_operands(rest)
        base = opcode.split(".")[0]
        target = None
        if base == "bra":
            target = resolve_label(ops[0].strip(), scope)
            ops = []
        dests: list[str] = []
        if base not in NO_DEST and ops:
            dests = [resolve(r, scope) for r in _REG.findall(ops[0])]
            ops = ops[1:]
        srcs = [resolve(r, scope) for op in ops for r in _REG.findall(op)]
        if guard:
            srcs.append(guard)
        return Instr(line, text, opcode, guard, dests, srcs, target)

    # -- analysis -------------------------------------------------------------------------------------
    def postdominators(self) -> dict[str, str | None]:
        """The immediate post-dominator of every block (None: only the exit post-dominates it)."""
        exit_ = "<exit>"
        succs = {b: (self.blocks[b].succs or [exit_]) for b in self.order}
        nodes = self.order + [exit_]
        pdom = {n: set(nodes) for n in nodes}
        pdom[exit_] = {exit_}
        changed = True
        while changed:
            changed = False
            for n in reversed(self.order):
                new = set.intersection(*(pdom[s] for s in succs[n])) | {n}
                if new != pdom[n]:
                    pdom[n], changed = new, True
        ipdom = {}
        for n in self.order:
            strict = pdom[n] - {n}
            # the immediate one: the strict post-dominator that every other strict one post-dominates
            cand = [p for p in strict if all(q in pdom[p] for q in strict)]
            ipdom[n] = None if not cand or cand[0] == exit_ else cand[0]
        return ipdom

    def region(self, block: str, ipdom: dict) -> set[str]:
        """The blocks a conditional branch at the end of ``block`` controls."""
        stop, seen = ipdom[block], set()
        todo = list(self.blocks[block].succs)
        while todo:
            b = todo.pop()
            if b == stop or b in seen:
                continue
            seen.add(b)
            todo.extend(self.blocks[b].succs)
        return seen


#: Memory-model qualifiers of a load: a load with one is a poll of memory another thread or GPU writes.
_ORDERED = {"volatile", "acquire", "relaxed", "sys", "gpu", "cluster"}
#: Special registers read at a thread's own time.
_CLOCKS = ("%clock", "%clock64", "%globaltimer")


def _is_varying_source(ins: Instr) -> bool:
    """Whether ``ins`` reads a value that may differ between the threads of a program by timing: a poll
    (a volatile or ordered load), an atomic, a clock."""
    words = ins.opcode.split(".")
    base = words[0]
    if base in ("ld", "ldu"):
        return bool(_ORDERED & set(words))
    if base in ("atom", "activemask"):
        return True
    return any(r.startswith(_CLOCKS) for r in ins.srcs)


def _is_shared_load(ins: Instr) -> bool:
    words = ins.opcode.split(".")
    return words[0] == "ld" and any(w.startswith("shared") for w in words)


def _varying(k: Kernel, ipdom) -> tuple[set[str], dict[str, set]]:
    """The registers that may differ between threads by timing (module docstring), and the blocks each
    conditional branch on one of them controls (by the branch's block)."""
    varying: set[str] = set()
    regions: dict[str, set] = {}
    all_instrs = [i for b in k.order for i in k.blocks[b].instrs]
    changed = True
    while changed:
        changed = False
        for ins in all_instrs:
            if not ins.dests:
                continue
            if _is_shared_load(ins):  # what every warp stored, read after a barrier
                var = ins.guard in varying if ins.guard else False
            else:
                var = _is_varying_source(ins) or any(s in varying for s in ins.srcs)
            if var and not set(ins.dests) <= varying:
                varying.update(ins.dests)
                changed = True
        for b in k.order:
            blk = k.blocks[b]
            if len(blk.succs) == 2 and blk.instrs and blk.instrs[-1].guard in varying:
                if b not in regions:
                    regions[b] = k.region(b, ipdom)
                for rb in regions[b]:
                    for ins in k.blocks[rb].instrs:
                        if ins.dests and not set(ins.dests) <= varying:
                            varying.update(ins.dests)
                            changed = True
    return varying, regions


def _position(k: Kernel) -> set[str]:
    """Registers computed from a thread's position (``%tid``, ``%laneid``) and other registers only, with
    no memory access: what an elected thread is picked by."""
    position: set[str] = set()
    changed = True
    while changed:
        changed = False
        for b in k.order:
            for ins in k.blocks[b].instrs:
                base = ins.opcode.split(".")[0]
                if not ins.dests or base in ("ld", "ldu", "atom", "shfl", "redux", "vote"):
                    continue
                if any(s.startswith(POSITION_SPECIALS) or s in position for s in ins.srcs) \
                        and not set(ins.dests) <= position:
                    position.update(ins.dests)
                    changed = True
    return position


def _elected(k: Kernel) -> set[str]:
    """Predicates that pick one thread: ``setp.eq`` of a position register with 0."""
    position = _position(k)
    return {d for b in k.order for ins in k.blocks[b].instrs
            if ins.opcode.startswith("setp.eq") and any(s in position for s in ins.srcs)
            and re.search(r",\s*0\s*$", ins.text) for d in ins.dests}


def analyse(ptx: str) -> list[Violation]:
    """Every barrier and elected store of the kernel that a branch on a per-thread value controls."""
    k = Kernel(ptx)
    _, regions = _varying(k, k.postdominators())
    elected = _elected(k)
    out = []
    for b, region in regions.items():
        br = k.blocks[b].instrs[-1]
        for rb in region:
            for ins in k.blocks[rb].instrs:
                if ins.opcode.startswith(BARRIERS):
                    out.append(Violation("barrier", ins.line, ins.text, br.line, br.text))
                elif ins.opcode.split(".")[0] in STORES and ins.guard in elected:
                    out.append(Violation("elected store", ins.line, ins.text, br.line, br.text))
    return sorted(out, key=lambda v: (v.line, v.branch_line))


def wait_loops(ptx: str) -> list[tuple[int, bool, bool]]:
    """``(line, uniform, barrier)`` of each loop of the kernel that polls memory or the clock (a wait
    loop): the line of its header's first statement, whether every branch that leaves it decides on a
    block-uniform value, and whether its body holds a barrier."""
    k = Kernel(ptx)
    ipdom = k.postdominators()
    varying, _ = _varying(k, ipdom)
    index = {b: n for n, b in enumerate(k.order)}
    preds: dict[str, list[str]] = {b: [] for b in k.order}
    for b in k.order:
        for s in k.blocks[b].succs:
            preds[s].append(b)
    reach, todo = set(), [k.order[0]]
    while todo:
        x = todo.pop()
        if x not in reach:
            reach.add(x)
            todo.extend(k.blocks[x].succs)
    dom = {b: set(reach) for b in reach}
    dom[k.order[0]] = {k.order[0]}
    changed = True
    while changed:
        changed = False
        for b in k.order[1:]:
            if b not in reach:
                continue
            new = set.intersection(*(dom[p] for p in preds[b] if p in reach)) | {b}
            if new != dom[b]:
                dom[b], changed = new, True
    loops: dict[str, set] = {}
    for b in k.order:
        for h in (k.blocks[b].succs if b in reach else ()):
            if h in dom[b]:  # a back edge b -> h: the natural loop of header h
                body, todo = {h}, [b]
                while todo:
                    x = todo.pop()
                    if x not in body:
                        body.add(x)
                        todo.extend(preds[x])
                loops.setdefault(h, set()).update(body)
    out = []
    for h, body in loops.items():
        instrs = [i for x in body for i in k.blocks[x].instrs]
        if not any(_is_varying_source(i) and i.opcode.split(".")[0] in ("ld", "mov") for i in instrs):
            continue
        exits = [k.blocks[x].instrs[-1] for x in body if k.blocks[x].instrs and k.blocks[x].instrs[-1].guard
                 and any(s not in body for s in k.blocks[x].succs)]
        first = next((i.line for x in sorted(body, key=index.get) for i in k.blocks[x].instrs), 0)
        out.append((first, all(e.guard not in varying for e in exits),
                    any(i.opcode.startswith(BARRIERS) for i in instrs)))
    return sorted(out)
