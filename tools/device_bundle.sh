#!/usr/bin/env bash
# Fill .device-bundle/ (git-ignored) with what kvd needs on the offline GPU machine and its image
# lacks (shared/FIELD-NOTES.md, "The GPU machine"); run here, where the registries answer:
#
#   wheels/           CPython 3.12 manylinux x86-64 wheels of the Python packages in
#                     tools/device_check/requirements.txt, each named, none pulled as a dependency
#   requirements.txt  what tools/device_check.sh installs from wheels/ (a copy of the above)
#   prefix/           static, position-independent liburing and ISA-L with their headers, for
#                     setup.py's KVD_NATIVE_PREFIX: liburing.a from Debian's liburing-dev, ISA-L built
#                     here from Debian's source package (Debian ships no libisal.a) with nasm
#   bin/fio           fio built statically from Debian's source package (the image has no fio)
#   MANIFEST.txt      where each piece came from, and the bundle's size
#
# Sources and build trees are kept under build/device-bundle/ so a second run is quick.
# Usage: tools/device_bundle.sh [BUNDLE_DIR]   (make device-bundle)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUNDLE=${1:-$ROOT/.device-bundle}
WORK=$ROOT/build/device-bundle
PYTHON=${PYTHON:-python3}
LIMIT_MIB=${KVD_BUNDLE_LIMIT_MIB:-48}
say() { printf '[device-bundle %(%H:%M:%S)T] %s\n' -1 "$*"; }

# A private apt configuration for source packages: the machine's lists stay as they are.
APT_DIR=$WORK/apt
APT_OPTIONS=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$APT_DIR/sources"
             -o "Dir::State::Lists=$APT_DIR/lists" -o "Dir::Cache=$APT_DIR/cache")

apt_sources() {
    [ -e "$APT_DIR/lists/.updated" ] && return
    mkdir -p "$APT_DIR/sources" "$APT_DIR/lists/partial" "$APT_DIR/cache"
    . /etc/os-release
    cat > "$APT_DIR/sources/source.sources" <<EOF
Types: deb deb-src
URIs: http://deb.debian.org/debian
Suites: $VERSION_CODENAME
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    say "apt: package and source lists of Debian $VERSION_CODENAME (private lists under $APT_DIR)"
    apt-get "${APT_OPTIONS[@]}" update -qq
    touch "$APT_DIR/lists/.updated"
}

# $1: source package; unpacks its upstream tarball under $WORK/src and prints the directory.
source_tree() {
    local package=$1 directory=$WORK/src/$1
    if [ ! -d "$directory" ]; then
        apt_sources
        mkdir -p "$WORK/download/$package" "$directory"
        (cd "$WORK/download/$package" && apt-get "${APT_OPTIONS[@]}" source --download-only -qq "$package" 2>/dev/null)
        tar -xf "$(ls "$WORK"/download/"$package"/*.orig.tar.* | grep -v '\.asc$' | head -n1)" -C "$directory" \
            --strip-components=1
    fi
    echo "$directory"
}

wheels() {
    local requirements=$ROOT/tools/device_check/requirements.txt
    say "wheels: $(grep -cv '^\s*\(#\|$\)' "$requirements") packages for CPython 3.12 manylinux x86-64, no dependencies"
    rm -rf "$BUNDLE/wheels"
    # --no-deps: every wheel is named in the list; the image's own packages (torch, CUDA) never come.
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
        --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$BUNDLE/wheels" -r "$requirements" \
        2> >(grep -v "is ignored: it is neither" >&2)
    cp "$requirements" "$BUNDLE/requirements.txt"
}

liburing() {
    local deb
    mkdir -p "$WORK/deb" "$BUNDLE/prefix/lib" "$BUNDLE/prefix/include"
    apt_sources
    (cd "$WORK/deb" && apt-get "${APT_OPTIONS[@]}" download -qq liburing-dev 2>/dev/null)
    deb=$(ls "$WORK"/deb/liburing-dev_*.deb | head -n1)
    rm -rf "$WORK/deb/root" && dpkg-deb -x "$deb" "$WORK/deb/root"
    cp -r "$WORK"/deb/root/usr/include/liburing* "$BUNDLE/prefix/include/"
    cp "$WORK"/deb/root/usr/lib/*/liburing.a "$BUNDLE/prefix/lib/"
    echo "liburing: $(basename "$deb") (headers, liburing.a)" >> "$BUNDLE/MANIFEST.txt"
}

isal() {
    local tree
    command -v nasm >/dev/null || { say "isa-l: installing nasm"; apt-get install -y -qq nasm >/dev/null; }
    tree=$(source_tree libisal)
    say "isa-l: building a static, position-independent library in $tree"
    # CFLAGS_gcc reaches the C compiler only (nasm gets the other flags); the assembly is position-independent.
    # (Its probes of the assembler's features print compiler errors: they are answers, not failures.)
    make -s -C "$tree" -f Makefile.unx -j"$(nproc)" lib CFLAGS_gcc=-fPIC >/dev/null 2>&1
    mkdir -p "$BUNDLE/prefix/include/isa-l" "$BUNDLE/prefix/lib"
    cp "$tree"/include/*.h "$BUNDLE/prefix/include/isa-l/"
    cp "$tree/isa-l.h" "$BUNDLE/prefix/include/" 2>/dev/null || true
    cp "$tree/bin/isa-l.a" "$BUNDLE/prefix/lib/libisal.a"
    echo "isa-l: Debian source package libisal $(ls "$WORK/download/libisal" | grep -o '[0-9][^_]*\.dsc$' | sed 's/\.dsc$//'), built with -fPIC" >> "$BUNDLE/MANIFEST.txt"
}

fio() {
    local tree
    tree=$(source_tree fio)
    if [ ! -x "$tree/fio" ]; then
        say "fio: building a static binary in $tree (a few minutes on 2 cores)"
        # Nothing optional: its own io_uring engine and the synchronous ones are what the sweep uses.
        (cd "$tree" && ./configure --build-static --disable-native --disable-numa --disable-rdma --disable-rados \
            --disable-rbd --disable-http --disable-gfapi --disable-libnfs --disable-pmem --disable-xnvme \
            --disable-libzbc --disable-tcmalloc --disable-dfs >/dev/null \
         && make -s -j"$(nproc)" fio >/dev/null 2>&1)
    fi
    mkdir -p "$BUNDLE/bin"
    cp "$tree/fio" "$BUNDLE/bin/fio"
    strip "$BUNDLE/bin/fio"
    echo "fio: Debian source package fio $("$BUNDLE/bin/fio" --version), static" >> "$BUNDLE/MANIFEST.txt"
}

main() {
    mkdir -p "$BUNDLE" "$WORK"
    : > "$BUNDLE/MANIFEST.txt"
    wheels
    liburing
    isal
    fio
    local size_kib
    size_kib=$(du -sk "$BUNDLE" | cut -f1)
    ls -1 "$BUNDLE/wheels" | sed 's/^/wheel: /' >> "$BUNDLE/MANIFEST.txt"
    echo "size: $((size_kib / 1024)) MiB ($size_kib KiB)" >> "$BUNDLE/MANIFEST.txt"
    say "bundle $BUNDLE: $((size_kib / 1024)) MiB ($size_kib KiB), limit $LIMIT_MIB MiB"
    du -sk "$BUNDLE"/* | sort -rn | sed 's/^/  KiB /'
    if [ "$size_kib" -gt $((LIMIT_MIB * 1024)) ]; then
        say "the bundle is over $LIMIT_MIB MiB: it would not travel with the working tree"
        exit 1
    fi
}

main
