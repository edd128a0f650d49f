# bfc_cuda.m4 -- optional CUDA runtime detection for libshardbfc.
#
# BFC_CHECK_CUDA follows UCX's config/m4/cuda.m4: --with-cuda=guess|yes|DIR|no
# (default guess).  "guess" and "yes" look in /usr/local/cuda when it exists
# and in the compiler's default paths otherwise; DIR looks only in DIR.  The
# user's CPPFLAGS/LDFLAGS/LIBS are saved before the probes and restored after,
# so nothing CUDA-specific leaks into the flags of the rest of the build; the
# results travel in CUDA_CPPFLAGS, CUDA_LDFLAGS and CUDA_LIBS instead.
#
# Only the runtime (libcudart) is linked, never the driver library (libcuda):
# a machine without the NVIDIA driver must still load the library and fall
# back to the SIM backend at run time.  CUDA_LDFLAGS carries an rpath to the
# runtime's directory so test programs and the installed library find
# libcudart without LD_LIBRARY_PATH.
#
# cudaStreamGetId (CUDA 12.0+) is required: the backend keys shards on it
# because a stream handle value is not a stable identity (cudaStreamPerThread).
#
# Results: bfc_cuda_happy (yes/no), bfc_cuda_dir (the prefix used, or
# "system"), bfc_cuda_version (the runtime's CUDART_VERSION as 13.0), the define BFC_HAVE_CUDA (always present, 0 or 1) and the
# automake conditional HAVE_CUDA; bfc_nvcc_happy, NVCC, NVCC_GENCODE and the
# conditional HAVE_NVCC for the GPU tests' kernels.
#
# "yes" or DIR without a usable CUDA is an error; "guess" without one builds
# without CUDA.

AC_DEFUN([BFC_CHECK_CUDA], [
AC_ARG_WITH([cuda],
    [AS_HELP_STRING([--with-cuda=guess|yes|DIR|no],
        [build the CUDA backend against the CUDA runtime in DIR
         (default: guess, looking in /usr/local/cuda)])],
    [], [with_cuda=guess])

bfc_cuda_happy=no
bfc_cuda_dir=
CUDA_CPPFLAGS=
CUDA_LDFLAGS=
CUDA_LIBS=

AS_CASE(["x$with_cuda"],
    [xno], [],
    [xguess|xyes|x], [AS_IF([test -d /usr/local/cuda],
                            [bfc_cuda_dir=/usr/local/cuda])],
    [bfc_cuda_dir="$with_cuda"
     AS_IF([test -d "$bfc_cuda_dir"], [],
           [AC_MSG_ERROR([--with-cuda=$with_cuda: no such directory])])])

AS_IF([test "x$with_cuda" != xno], [
    AS_IF([test -n "$bfc_cuda_dir"], [
        CUDA_CPPFLAGS="-I$bfc_cuda_dir/include"
        AS_IF([test -d "$bfc_cuda_dir/lib64"],
              [bfc_cuda_libdir="$bfc_cuda_dir/lib64"],
              [bfc_cuda_libdir="$bfc_cuda_dir/lib"])
        CUDA_LDFLAGS="-L$bfc_cuda_libdir -Wl,-rpath,$bfc_cuda_libdir"
    ])

    bfc_save_CPPFLAGS="$CPPFLAGS"
    bfc_save_LDFLAGS="$LDFLAGS"
    bfc_save_LIBS="$LIBS"
    CPPFLAGS="$CUDA_CPPFLAGS $CPPFLAGS"
    LDFLAGS="$CUDA_LDFLAGS $LDFLAGS"

    bfc_cuda_happy=yes
    # Probe with private cache variables: a re-run with another DIR must
    # not reuse an earlier answer.
    AC_MSG_CHECKING([for cuda_runtime.h])
    AC_COMPILE_IFELSE([AC_LANG_PROGRAM([[#include <cuda_runtime.h>]],
                                       [[cudaStream_t s = 0; (void)s;]])],
                      [AC_MSG_RESULT([yes])],
                      [AC_MSG_RESULT([no]); bfc_cuda_happy=no])
    AS_IF([test $bfc_cuda_happy = yes], [
        LIBS="-lcudart $LIBS"
        # Both stream queries the backend calls: cudaStreamGetId came with
        # CUDA 12.0, cudaStreamGetDevice with a later 12.x, and a runtime
        # without it passed this check and failed the build.
        AC_MSG_CHECKING([for cudaStreamGetId and cudaStreamGetDevice in -lcudart])
        AC_LINK_IFELSE([AC_LANG_PROGRAM([[#include <cuda_runtime.h>]],
            [[unsigned long long id; int n, d;
              (void)cudaGetDeviceCount(&n);
              (void)cudaStreamGetDevice(0, &d);
              return (int)cudaStreamGetId(0, &id);]])],
            [AC_MSG_RESULT([yes])],
            [AC_MSG_RESULT([no]); bfc_cuda_happy=no])
    ])
    AS_IF([test $bfc_cuda_happy = yes], [
        AC_COMPUTE_INT([bfc_cudart_version], [CUDART_VERSION],
                       [[#include <cuda_runtime_api.h>]],
                       [bfc_cudart_version=0])
        bfc_cuda_version="`expr $bfc_cudart_version / 1000`.`expr $bfc_cudart_version % 1000 / 10`"
    ])

    CPPFLAGS="$bfc_save_CPPFLAGS"
    LDFLAGS="$bfc_save_LDFLAGS"
    LIBS="$bfc_save_LIBS"

    AS_IF([test $bfc_cuda_happy = yes],
          [CUDA_LIBS="-lcudart"
           AS_IF([test -z "$bfc_cuda_dir"], [bfc_cuda_dir=system])],
          [CUDA_CPPFLAGS=
           CUDA_LDFLAGS=
           AS_CASE(["x$with_cuda"],
               [xguess|x], [AC_MSG_NOTICE([CUDA runtime not found: building without the CUDA backend])
                            bfc_cuda_dir=],
               [AC_MSG_ERROR([--with-cuda=$with_cuda: no usable CUDA runtime (need cuda_runtime.h and libcudart with cudaStreamGetId and cudaStreamGetDevice, CUDA 12)])])])
])

# nvcc, for the GPU-only tests' kernels (tests/gpu/*.cu).  Looked for only
# when the runtime was found, first beside it, so a --without-cuda build
# never runs it.  NVCC_GENCODE picks the GPU architectures: native code for
# Ampere (sm_80) and Hopper (sm_90, the H100/H200) plus compute_90 PTX that
# the driver compiles for newer GPUs.  A toolkit without nvcc (a runtime-only
# install) still builds the CUDA backend; its GPU tests then skip, saying so.
AC_ARG_VAR([NVCC], [CUDA compiler for the GPU tests' kernels (default: nvcc beside the runtime)])
AC_ARG_VAR([NVCCFLAGS], [extra flags for NVCC])
AC_ARG_VAR([NVCC_GENCODE], [NVCC architecture flags (default: sm_80, sm_90 and compute_90 PTX)])
bfc_nvcc_happy=no
AS_IF([test $bfc_cuda_happy = yes], [
    AS_IF([test "x$bfc_cuda_dir" != xsystem],
          [AC_PATH_PROG([NVCC], [nvcc], [], [$bfc_cuda_dir/bin$PATH_SEPARATOR$PATH])],
          [AC_PATH_PROG([NVCC], [nvcc], [])])
    AS_IF([test -z "$NVCC_GENCODE"],
          [NVCC_GENCODE="-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90"])
    AS_IF([test -n "$NVCC"], [
        AC_MSG_CHECKING([whether $NVCC compiles a kernel for $NVCC_GENCODE])
        cat > conftest.cu <<_BFCEOF
__global__ void bfc_conftest(int *p) { p@<:@threadIdx.x@:>@ = 1; }
_BFCEOF
        AS_IF([$NVCC $NVCC_GENCODE $NVCCFLAGS -c conftest.cu -o conftest.$OBJEXT >&AS_MESSAGE_LOG_FD 2>&1],
              [bfc_nvcc_happy=yes], [bfc_nvcc_happy=no])
        rm -f conftest.cu conftest.$OBJEXT
        AC_MSG_RESULT([$bfc_nvcc_happy])
    ])
])
# Kernels compile as warning-free as the C code: the host compiler's -Wall
# -Wextra (and -Werror unless --disable-werror), nvcc's own warnings too.
NVCC_WARN_FLAGS="-Xcompiler -Wall,-Wextra"
AS_IF([test "x$enable_werror" != xno],
      [NVCC_WARN_FLAGS="-Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror"])
AC_SUBST([NVCC_GENCODE])
AC_SUBST([NVCC_WARN_FLAGS])
AM_CONDITIONAL([HAVE_NVCC], [test $bfc_nvcc_happy = yes])

AS_IF([test $bfc_cuda_happy = yes],
      [AC_DEFINE([BFC_HAVE_CUDA], [1], [Define to 1 when the CUDA backend is built.])],
      [AC_DEFINE([BFC_HAVE_CUDA], [0], [Define to 1 when the CUDA backend is built.])])
AC_SUBST([CUDA_CPPFLAGS])
AC_SUBST([CUDA_LDFLAGS])
AC_SUBST([CUDA_LIBS])
AM_CONDITIONAL([HAVE_CUDA], [test $bfc_cuda_happy = yes])
])
