"""Rootdir and ini file for runs that pass a path-valued suite option in its two-word form.

pytest chooses the rootdir and the ini file before it loads installed plugins, from a first
parse that knows only its own options: in `pytest -m perf --config-grid /home/me/grid.yaml`
the unknown `--config-grid` is set aside and `/home/me/grid.yaml` is taken for a test path, so
the rootdir becomes /home/me and the repository's ini file (testpaths, addopts, markers) is never
read (pytest-dev/pytest#8846, closed as a known limitation; `--config-grid=/home/me/grid.yaml`
is not affected). No public hook runs before that choice, so once the plugin is loaded this module
repeats it with the suite's options known and, only when the answer differs, puts the right
rootdir, ini file and ini addopts in place before the initial conftests load. It touches pytest's
private `_rootpath`/`_inipath`/`_inicfg` (the same names in pytest 8.2-9.1, which pyproject
pins), and fails with the `--flag=value` advice where they are absent.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import pytest

_PRIVATE = ("_rootpath", "_inipath", "_inicfg")


def two_word_flags(args: list[str], flags: Iterable[str]) -> list[str]:
    """The flags of `flags` written as `--flag VALUE` (two words) in `args`."""
    known = set(flags)
    return [a for i, a in enumerate(args[:-1]) if a in known]


def redo_ini_setup(early_config: pytest.Config, parser: pytest.Parser, args: list[str],
                   flags: Iterable[str]) -> bool:
    """Re-determine rootdir and ini file now that `flags` are known; True when it changed them."""
    used = two_word_flags(args, flags)
    if not used:
        return False
    from _pytest.config.findpaths import determine_setup

    ns = parser.parse_known_args(args)
    rootpath, inipath, inicfg, ignored = determine_setup(
        inifile=ns.inifilename, override_ini=ns.override_ini, args=ns.file_or_dir,
        rootdir_cmd_arg=ns.rootdir or None, invocation_dir=early_config.invocation_params.dir)
    if (rootpath, inipath) == (early_config.rootpath, early_config.inipath):
        return False
    if not all(hasattr(early_config, name) for name in _PRIVATE):
        raise pytest.UsageError(
            f"{', '.join(used)}: pytest took the value for a test path and chose rootdir "
            f"{early_config.rootpath}; write {used[0]}=VALUE (one word) with this pytest version")
    early_config._rootpath = rootpath
    early_config._inipath = inipath
    early_config._inicfg = inicfg
    early_config._ignored_config_files = ignored
    getattr(early_config, "_inicache", {}).clear()
    parser.extra_info["rootdir"] = str(rootpath)
    parser.extra_info["inifile"] = str(inipath)
    addopts = list(early_config.getini("addopts"))
    args[:] = addopts + args
    early_config.known_args_namespace = parser.parse_known_args(args, namespace=copy.copy(early_config.option))
    early_config.pluginmanager.consider_preparse(addopts, exclude_only=False)  # e.g. -p no:cacheprovider
    if ns.confcutdir is None:  # pytest derived it from the wrong rootdir a moment ago
        early_config.known_args_namespace.confcutdir = str(inipath.parent if inipath else rootpath)
    return True
