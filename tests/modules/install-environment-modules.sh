#!/usr/bin/env bash
# Installs Debian's Environment Modules into its own prefix (default /var/tmp/jobgen-environment-modules),
# beside Lmod: the two Debian packages conflict (both give login shells a `module`), and the tests
# need both. A site that builds Environment Modules under /opt or /usr/local has the same layout:
# PREFIX/share/modules/init/bash, found through MODULESHOME. Nothing outside PREFIX is touched;
# /etc/profile.d keeps Lmod's `module`. Needs tclsh8.6 (Lmod's Debian package brings it).
set -euo pipefail
prefix=${1:-/var/tmp/jobgen-environment-modules}
if [[ -f $prefix/share/modules/init/bash ]]; then
  exit 0
fi
workdir=$(mktemp -d)
chown _apt "$workdir" 2>/dev/null || true  # apt downloads as its own user
trap 'rm -rf "$workdir"' EXIT
# apt-get download needs the package lists: fetch them if this machine has none yet.
(cd "$workdir" && { apt-get download environment-modules > /dev/null 2>&1 || { apt-get update -qq && apt-get download environment-modules > /dev/null; }; })
dpkg-deb -x "$workdir"/environment-modules_*.deb "$workdir/root"
mkdir -p "$prefix/share" "$prefix/libexec"
cp -a "$workdir/root/usr/share/modules" "$prefix/share/"
cp -a "$workdir/root/etc/environment-modules" "$prefix/etc"
# /usr/lib/MULTIARCH (x86_64-linux-gnu on amd64) holds the command and its Tcl extension.
libdir=$(find "$workdir/root/usr/lib" -mindepth 2 -name modulecmd.tcl -printf '%h\n' | head -n 1)
cp -a "$libdir/modulecmd.tcl" "$libdir/libtclenvmodules.so" "$prefix/libexec/"
libdir=${libdir#"$workdir/root"}
# The package's paths are compiled in: point them at the prefix.
sed -i -e "s#$libdir/modulecmd.tcl#$prefix/libexec/modulecmd.tcl#g" \
  -e "s#$libdir#$prefix/libexec#g" \
  -e "s#/usr/share/modules#$prefix/share/modules#g" \
  -e "s#/etc/environment-modules#$prefix/etc#g" \
  "$prefix/libexec/modulecmd.tcl" "$prefix"/share/modules/init/{bash,sh,ksh,zsh,profile.sh} "$prefix"/etc/{modulespath,initrc}
echo "Environment Modules installed in $prefix (MODULESHOME=$prefix/share/modules)"
