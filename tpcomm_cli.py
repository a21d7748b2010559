"""The ``tpcomm`` console script's front: the command line is parsed before torch is imported.

Importing any module of the tpcomm package runs the package's ``__init__``, which imports torch and
Triton (about 2 s on 2 cores). The whole parser is one file of the standard library only,
``tpcomm/arguments.py``, so this module loads that file by its path, without the package, and parses:
``--help``, ``--version`` and a bad option end here, at once. Only a valid command imports tpcomm
(:func:`tpcomm.cli.run`). ``python -m tpcomm`` takes the same arguments, after importing the package.
"""

from __future__ import annotations

import importlib.util
import os


def _package_file(name: str):
    """The module in ``tpcomm/<name>.py``, loaded by its path under a name of its own (the tpcomm package
    itself is found but not imported)."""
    package = importlib.util.find_spec("tpcomm")
    if package is None or not package.submodule_search_locations:
        raise SystemExit("tpcomm: the tpcomm package is not installed beside this script")
    for folder in package.submodule_search_locations:
        path = os.path.join(folder, f"{name}.py")
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location(f"_tpcomm_cli_{name}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise SystemExit(f"tpcomm: no {name}.py in the tpcomm package ({package.submodule_search_locations})")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tpcomm`` console script: parse, then run; returns the exit status."""
    arguments, version = _package_file("arguments"), _package_file("version")
    args = arguments.build_parser(version.__version__).parse_args(argv)
    from tpcomm.cli import run

    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
