"""Builds kvd._native, the io_uring batch engine, from native/.

Everything else about the package is in pyproject.toml; this file only
exists because the compiler flags depend on the environment:

    KVD_NATIVE_DEBUG=1      -O0 -g (step through it in gdb); addresses checked
                            against registered buffers (KVD_CHECK_ADDRESSES)
    KVD_NATIVE_SANITIZE=1   -O1 -g with AddressSanitizer and UBSan, addresses
                            checked too; Python
                            itself is not instrumented, so run it with
                            libasan preloaded (`make native-sanitize` does)

    KVD_NATIVE_PREFIX=DIR   liburing and ISA-L from DIR/include and DIR/lib,
                            linked statically (DIR/lib/liburing.a,
                            DIR/lib/libisal.a), so the extension needs neither
                            library at run time: the offline GPU machine's build
                            from .device-bundle/prefix (`make device-bundle`)

Release builds use -O2. Every build treats warnings as errors. The build
needs gcc, liburing and Intel ISA-L (Debian: liburing-dev, libisal-dev;
`make setup` installs them), or a prefix holding both.
"""

from __future__ import annotations

import os

from setuptools import Extension, setup


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _libraries() -> dict:
    """How the extension finds liburing and ISA-L: the system's shared libraries, or static ones
    under KVD_NATIVE_PREFIX (searched before the system's headers, so a prefix always wins)."""
    prefix = os.environ.get("KVD_NATIVE_PREFIX", "")
    if not prefix:
        return {"libraries": ["uring", "isal"], "include_dirs": [], "extra_objects": []}
    archives = [os.path.join(prefix, "lib", name) for name in ("liburing.a", "libisal.a")]
    missing = [path for path in archives if not os.path.isfile(path)]
    if missing:
        raise SystemExit(f"KVD_NATIVE_PREFIX={prefix}: missing {', '.join(missing)}")
    return {"libraries": [], "include_dirs": [os.path.join(prefix, "include")], "extra_objects": archives}


def native_extension() -> Extension:
    compile_args = ["-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"]
    link_args: list[str] = []
    if _flag("KVD_NATIVE_SANITIZE"):
        sanitizers = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
        compile_args += ["-O1", "-g", "-DKVD_CHECK_ADDRESSES", *sanitizers]
        link_args += sanitizers
    elif _flag("KVD_NATIVE_DEBUG"):
        compile_args += ["-O0", "-g", "-DKVD_CHECK_ADDRESSES"]
    else:
        compile_args += ["-O2"]
    libraries = _libraries()
    if libraries["extra_objects"]:
        link_args += ["-Wl,--exclude-libs,ALL"]  # the archives' symbols stay inside the extension
    return Extension(
        "kvd._native",
        sources=["native/module.c", "native/uring_batch.c", "native/checksum.c", "native/prefix.c",
                 "native/ring_proxy.c", "native/cuda_copy.c", "native/proxy_module.c",
                 "native/cuda_batch.c", "native/planner.c", "native/planner_module.c"],
        depends=["native/uring_batch.h", "native/checksum.h", "native/prefix.h", "native/module.h",
                 "native/ring_proxy.h", "native/cuda_copy.h", "native/gpu/io_ring.h", "native/planner.h"],
        include_dirs=[*libraries["include_dirs"], "native"],
        libraries=libraries["libraries"],
        extra_objects=libraries["extra_objects"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )


setup(ext_modules=[native_extension()])
