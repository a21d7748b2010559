"""A griffe extension for the API reference (mkdocstrings): tpcomm's docstrings cross-reference with Sphinx
roles (:class:`~tpcomm.Communicator`, :func:`...`, :meth:`...`), which mkdocstrings would print as they
are. Once the package is loaded, each role becomes a cross-reference to the object it names, resolved in
the docstring's scope as Python resolves the name (``Communicator._run`` inside ``tpcomm.communicator``
is ``tpcomm.communicator.Communicator._run``): a link where the reference documents that object, the
name in code where it does not (an optional cross-reference of mkdocs-autorefs). A role it cannot read
is logged as an error, which fails the strict build (quiet or not: ``-q`` hides warnings from strict
mode, not errors).

It also drops the ``key`` parameter from the signatures of ``tpcomm.collectives``: the call-cache key
a communicator passes its op's module, not an argument a user gives.
"""

from __future__ import annotations

import re

import griffe

#: A Sphinx cross-reference role: ``:kind:`~target` `` (``~``: show the last component), ``()`` allowed.
ROLE = re.compile(r":(?:py:)?(?P<kind>class|func|meth|mod|attr|data|exc|obj):"
                  r"`(?P<short>~?)(?P<target>[\w.]+)(?:\(\))?`")
#: Whatever still looks like a role after the conversion (an error: the site would show it raw).
LEFTOVER = re.compile(r":\w+:`")
#: Parameters that are the package's own plumbing, by the module prefix of the functions that take them.
INTERNAL_PARAMETERS = {"tpcomm.collectives.": ("key",)}


def resolve(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as named in ``obj``'s docstring (itself when it cannot be resolved)."""
    if target.startswith("tpcomm."):
        return target
    head, _, rest = target.partition(".")
    scope = obj
    while scope is not None:
        try:
            path = scope.resolve(head)
            return f"{path}.{rest}" if rest else path
        except Exception:  # griffe.NameResolutionError, or a scope that cannot resolve
            scope = scope.parent
    return target


def convert(obj: griffe.Object, text: str) -> str:
    """``text`` with every role replaced by an optional cross-reference (:func:`resolve`)."""
    def replace(m: re.Match) -> str:
        target = m["target"]
        title = target.rsplit(".", 1)[-1] if m["short"] else target
        if m["kind"] in ("func", "meth"):
            title += "()"
        return f'<autoref identifier="{resolve(obj, target)}" optional><code>{title}</code></autoref>'

    return ROLE.sub(replace, text)


class SphinxRoles(griffe.Extension):
    """Converts every docstring of the loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None:
                value = convert(obj, obj.docstring.value)
                if value != obj.docstring.value:
                    obj.docstring.value = value
                    obj.docstring.__dict__.pop("parsed", None)  # parsed again from the new text
                left = LEFTOVER.search(value)
                if left:
                    griffe.logger.error(f"{obj.path}: a Sphinx role the API reference cannot render: "
                                          f"{value[left.start():left.start() + 60]!r}")
            if isinstance(obj, griffe.Function):
                for prefix, names in INTERNAL_PARAMETERS.items():
                    if obj.path.startswith(prefix):
                        for name in names:
                            if name in obj.parameters:
                                del obj.parameters[name]


def _objects(obj: griffe.Object):
    """``obj`` and every object defined under it (aliases skipped: their targets are visited where defined)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)
