"""Where Numba caches this package's compiled kernels, and when a cached one is stale.

Numba stamps a cached kernel with its own file's contents only, so a kernel that inlines
code from another file (``slots``' rounds inline ``counters``' atomics) would survive an
upgrade that changed only that file. Here a locator of ours, first in Numba's list for this
package's files alone, stamps every kernel with a hash of every module of the package: a
change anywhere recompiles them all. Kernels are cached under ``NUMBA_CACHE_DIR`` when it
is set, else in ``__pycache__`` beside the package, else in Numba's user-wide cache
directory, the first of them that is writable. Where none is (a read-only install with an
unwritable home), :data:`CACHE` is False: the kernels are compiled afresh in each process,
and one warning says so. Every kernel is declared ``njit(cache=CACHE)``.

(A ``NUMBA_CACHE_LOCATOR_CLASSES`` of the user's replaces Numba's list, ours included.)
"""

from __future__ import annotations

import hashlib
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from numba.core import caching, config
from numba.misc.appdirs import AppDirs

PACKAGE = Path(__file__).resolve().parent


def sources_stamp(package: Path = PACKAGE) -> str:
    """A hash of the names and contents of every module of ``package``."""
    digest = hashlib.sha256()
    for path in sorted(package.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError:
        return False
    return True


def cache_directory(package: Path = PACKAGE) -> Path | None:
    """The first writable of ``NUMBA_CACHE_DIR``, the package's ``__pycache__`` and Numba's
    user-wide cache directory (each under a subdirectory named for the package's path), or None."""
    subpath = f"{package.name}_{hashlib.sha1(str(package).encode()).hexdigest()}"
    candidates = [package / "__pycache__", Path(AppDirs(appname="numba", appauthor=False).user_cache_dir) / subpath]
    given = config.CACHE_DIR  # type: ignore[attr-defined]  # numba's config sets its attributes at run time
    if given:
        candidates.insert(0, Path(given) / subpath)
    return next((directory for directory in candidates if _writable(directory)), None)


class KernelLocator(caching._CacheLocator):
    """Numba's cache locator for this package's kernels: one directory, one stamp for them all."""

    directory: Path
    stamp: str

    def __init__(self, py_func: Callable[..., Any]) -> None:
        self._lineno = py_func.__code__.co_firstlineno

    def ensure_cache_path(self) -> None:
        """Checked writable once, when the directory was chosen."""

    def get_cache_path(self) -> str:
        return str(self.directory)

    def get_source_stamp(self) -> str:
        return self.stamp

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func: Callable[..., Any], py_file: str) -> KernelLocator | None:
        if Path(py_file).resolve().parent != PACKAGE:
            return None  # another package's function: Numba's own locators
        return cls(py_func)


def _install() -> bool:
    """Put :class:`KernelLocator` first in Numba's list; whether this package's kernels can be cached."""
    directory = cache_directory()
    if directory is None:
        warnings.warn(
            f"mpisolve: no writable location for Numba's kernel cache (NUMBA_CACHE_DIR unset or not writable, "
            f"{PACKAGE / '__pycache__'} and Numba's user-wide cache directory not writable): the kernels are "
            "compiled in each process. Set NUMBA_CACHE_DIR to a writable directory to keep them",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    KernelLocator.directory = directory
    KernelLocator.stamp = sources_stamp()
    locators = cast(list[Any], caching.CacheImpl._locator_classes)  # the list every Numba cache reads
    if KernelLocator not in locators:
        locators.insert(0, KernelLocator)
    return True


#: Whether the kernels are cached (``njit(cache=CACHE)``): False where no location is writable.
CACHE = _install()
