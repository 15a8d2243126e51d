"""Print the SIMD features that this NumPy build dispatches at run time and this CPU has.

    NPY_DISABLE_CPU_FEATURES="$(.venv/bin/python tools/npy_simd_features.py)" ...   # make test-notebooks-nosimd

NumPy picks a SIMD implementation of many ufuncs at import time (float16 and float32 exp/log, sums,
sorts, ...). Listing the features printed here in NPY_DISABLE_CPU_FEATURES makes it use its baseline
code instead, so a second nbval run shows whether any stored notebook output depends on the SIMD path.
The list is computed on the machine that runs the tests: NumPy refuses to disable a baseline feature,
and warns about a feature it does not dispatch or the CPU lacks, so a hard-coded list would break on
CI machines whose CPUs (or NumPy builds) differ. Prints nothing where there is nothing to disable.
"""
try:  # NumPy 2
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
except ImportError:  # NumPy 1.x
    from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__

print(" ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f)))
