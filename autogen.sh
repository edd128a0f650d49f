#!/bin/sh
# autogen.sh -- generate ./configure from configure.ac and Makefile.am.
# Needs autoconf, automake, libtool and pkg-config (for pkg.m4).
set -e
cd "$(dirname "$0")"
mkdir -p m4 build-aux
autoreconf --force --install --warnings=all "$@"
echo "Now run ./configure (or mkdir build && cd build && ../configure)."
