"""Compile once per machine: the model step's and the sampler's executables, serialized.

They are kept in one folder, `$JAXPAGED_HOME/compile-cache/<jax>-<jaxlib>-<backend>-<machine>/`
(default `~/.cache/jaxpaged/...`; `JAXPAGED_COMPILATION_CACHE_DIR` or
`LLM(compilation_cache_dir=...)` moves it, "off" turns it off), as
`jax.experimental.serialize_executable` payloads under a key of everything that makes the
program: the function, the model config (shapes, dtypes, RoPE constants), the dtype, the
attention backend, the input shapes, dtypes and shardings, the static arguments, the devices,
jax and jaxlib, the CPU, XLA_FLAGS, and the source of jaxpaged itself. A hit loads an
executable in about 0.2 s without tracing; any change of those factors is a different key,
never a wrong entry. Entries are also kept in memory for the process, so a second engine on
the same model and limits reuses them while the first holds them, or for the last 64 used
after it is gone.

JAX's own persistent cache (`jax_compilation_cache_dir`) is not turned on. XLA:CPU cannot
serialize an executable correctly in a process that has loaded another one (the copy on disk
then fails when run: "Function ... not found"), so a process writes executables only until it
loads its first, from this cache or from JAX's. With JAX's cache on, any program that ever
landed there (a step shape, keyed by JAX on its HLO rather than on jaxpaged's source and
options; a helper that once took a second to compile under load) was loaded early in every
later process, which then wrote nothing: after an upgrade of jaxpaged, every start stayed
cold. The small helpers JAX's cache would hold (the weights' layout, the pool's zeros, row
gathers) take a few tenths of a second in all. A JAX cache that the user turns on is used as
JAX uses it, and a hit in it counts as a load.

The folder name separates jax versions, backends and machines (XLA's CPU code is built for the
host CPU's features), so entries of another installation are never read; deleting the folder is
always safe.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
import weakref
from pathlib import Path

import jax

from jaxpaged import envs
from jaxpaged.platforms import current_platform

logger = logging.getLogger(__name__)

ENV_VAR = envs.COMPILATION_CACHE_DIR_VAR
_OFF = ("", "0", "off", "false", "none")

# One load at a time: XLA:CPU links every loaded executable's code into the process's JIT
# session, and concurrent loads were seen to fail with "Function ... not found".
_load_lock = threading.Lock()
_recent_lock = threading.Lock()
# Once a process has loaded an executable (from this cache, or from JAX's where the user turned
# it on), it writes none: XLA:CPU serializes an executable compiled or loaded beside loaded ones
# without all of its code (a later load fails with "Function ... not found", or serializing
# crashes). A warm process compiles little; what it does compile is written by the next cold one.
_loaded_any = False


def _stop_writing() -> None:
    global _loaded_any
    _loaded_any = True


def _count_jax_cache_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _stop_writing()


jax.monitoring.register_event_listener(_count_jax_cache_hit)


def resolve_cache_dir(option: str | os.PathLike | None = "auto") -> Path | None:
    """The cache folder for `LLM(compilation_cache_dir=option)`, or None when it is off.

    Args:
      option: "auto" (`$JAXPAGED_COMPILATION_CACHE_DIR` if set, else
        `$JAXPAGED_HOME/compile-cache`), a folder, or None / "off" for no cache.

    Returns:
      The folder for this jax/jaxlib version, backend and machine (created on first write).
    """
    if option == "auto":
        option = envs.compilation_cache_dir()
        if option is None:
            option = envs.jaxpaged_home() / "compile-cache"
    if option is None or str(option).strip().lower() in _OFF:
        return None
    return Path(option).expanduser() / current_platform().cache_folder_name()


@functools.cache
def _source_digest() -> str:
    """sha256 of jaxpaged's own source (engine, models, kernels): an edit is a new program."""
    import jaxpaged
    from jaxpaged import models, pallas_kernels

    h = hashlib.sha256()
    for package in (jaxpaged, models, pallas_kernels):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".cc") and "__pycache__" not in path.parts:
                h.update(path.relative_to(root).as_posix().encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def _aval(x) -> str:
    """Shape, dtype and partitioning of one input. On one device there is none: an array's
    sharding type changes there (a step's outputs come back with a 1x1 mesh's) but not the
    program."""
    sharding = getattr(x, "sharding", None)
    spec = (None if sharding is None or len(sharding.device_set) == 1
            else getattr(sharding, "spec", sharding))
    return f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:{spec}"


class ExecutableCache:
    """Executables of one model's jitted functions, by their inputs' shapes: in memory for the
    process, and serialized under `cache_dir/executables/` (None: in memory only).

    Args:
      cache_dir: `resolve_cache_dir(...)`, or None.
      program: what fixes the step's program besides its inputs' shapes: the model config's
        repr, dtype, attention backend name, limits (strings, hashed with the rest).
      devices: the devices the executables run on, in mesh order (default: the first device).
    """

    # Shared by the engines of the process while one of them holds an executable (weakly: each
    # loaded executable maps ~90 memory regions, and Linux allows a process 65,530), and the
    # last `NUM_RECENT` used kept alive after their engine is gone, for the next engine on the
    # same model and limits (a sweep, a test suite) to reuse without a compile or a load.
    _memory: weakref.WeakValueDictionary[str, jax.stages.Compiled] = weakref.WeakValueDictionary()
    _recent: collections.OrderedDict[str, jax.stages.Compiled] = collections.OrderedDict()
    NUM_RECENT = 64

    def __init__(self, cache_dir: Path | None, program: tuple[str, ...],
                 devices: list | None = None):
        # Several processes (jax.distributed) each build their own part of a program: kept
        # in memory only (JAX's own cache still serves them).
        self.folder = (None if cache_dir is None or jax.process_count() > 1
                       else cache_dir / "executables")
        self._base = hashlib.sha256("\0".join([
            *current_platform().cache_key_parts(), str(jax.config.jax_enable_x64),
            str(jax.config.jax_default_matmul_precision), _source_digest(),
            *program]).encode())
        # The devices the executables run on, in their mesh's order (a loaded executable is
        # otherwise given every device of the backend, and fails on fewer).
        self.devices = list(devices) if devices else jax.devices()[:1]
        self.num_loaded = 0  # executables read from disk
        self.num_on_disk = 0  # found on disk by `get_or_compile(load=False)`, left to load
        self.num_compiled = 0  # executables compiled (then written)

    def key(self, jitted, args: tuple, static: tuple) -> str:
        """The key of `jitted(*args, *static_args, **static_kwargs)`, `args` pytrees of
        arrays, `static` = (static_args, static_kwargs)."""
        h = self._base.copy()
        leaves, treedef = jax.tree.flatten(args)
        h.update(getattr(jitted, "__qualname__", repr(jitted)).encode())
        h.update(str(treedef).encode())
        h.update("|".join(map(_aval, leaves)).encode())
        h.update(repr((static[0], sorted(static[1].items()))).encode())
        return h.hexdigest()[:32]

    def get_or_compile(self, jitted, args: tuple, static_args: tuple = (),
                       static_kwargs: dict | None = None, load: bool = True
                       ) -> jax.stages.Compiled | None:
        """The executable of `jitted(*args, *static_args, **static_kwargs)` (static arguments
        positional where jit has in_shardings, which takes no keywords): from memory, from disk,
        or compiled (then kept in both). A damaged or unloadable file is replaced.

        With `load=False`, an entry on disk is left there and None returned (the caller loads
        it when it first runs it: `precompile` of a warm start then reads no executable); one
        that is not there is compiled and written as with `load=True`."""
        from jax.experimental import serialize_executable

        static_kwargs = static_kwargs or {}
        key = self.key(jitted, args, (static_args, static_kwargs))
        compiled = self._memory.get(key)
        if compiled is not None:
            self._remember(key, compiled)
            return compiled
        path = None if self.folder is None else self.folder / f"{key}.bin"
        if not load and path is not None and path.is_file():
            self.num_on_disk += 1
            return None
        if path is not None and path.is_file():
            try:
                payload, in_tree, out_tree = pickle.loads(path.read_bytes())
                if in_tree != jax.tree.structure((args, {})):
                    raise ValueError("its inputs differ")
                with _load_lock:
                    _stop_writing()
                    compiled = serialize_executable.deserialize_and_load(
                        payload, in_tree, out_tree, execution_devices=self.devices)
                self.num_loaded += 1
            except Exception as e:  # a truncated file, or one jax cannot load: compile anew
                logger.warning("compilation cache: cannot load %s (%s); compiling", path, e)
        if compiled is None:
            compiled = jitted.lower(*args, *static_args, **static_kwargs).compile()
            self.num_compiled += 1
            if path is not None and not _loaded_any:
                self._write(path, pickle.dumps(serialize_executable.serialize(compiled)))
        self._memory[key] = compiled
        self._remember(key, compiled)
        return compiled

    @classmethod
    def _remember(cls, key: str, compiled: jax.stages.Compiled) -> None:
        with _recent_lock:  # precompile's two threads
            cls._recent[key] = compiled
            cls._recent.move_to_end(key)
            while len(cls._recent) > cls.NUM_RECENT:
                cls._recent.popitem(last=False)

    @staticmethod
    def _write(path: Path, payload: bytes) -> None:
        """Written aside, then renamed: readers never see half a file."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:  # a read-only or full disk costs a compile next time, no more
            logger.warning("compilation cache: cannot write %s (%s)", path, e)
