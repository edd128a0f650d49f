# bfc_pkg.m4 -- required dependencies found with pkg-config.
#
# BFC_REQUIRE_PKG(VARIABLE-PREFIX, MODULE, DEBIAN-PACKAGE)
#
# Runs PKG_CHECK_MODULES for MODULE and stops configure, naming the Debian
# package that provides it, when it is missing.  On success VARIABLE-PREFIX
# _CFLAGS/_LIBS are substituted (by PKG_CHECK_MODULES) and
# bfc_version_<VARIABLE-PREFIX> holds `pkg-config --modversion MODULE` for the
# configure summary.

AC_DEFUN([BFC_REQUIRE_PKG], [
PKG_CHECK_MODULES([$1], [$2], [],
    [AC_MSG_ERROR([$2 not found by pkg-config.
    On Debian/Ubuntu install it with:   apt-get install $3
    (or run scripts/bootstrap.sh, which installs every missing package).
    If it is installed elsewhere, set PKG_CONFIG_PATH or $1_CFLAGS/$1_LIBS.
    pkg-config said: $$1_PKG_ERRORS])])
bfc_version_$1=`$PKG_CONFIG --modversion "$2" 2>/dev/null`
])
