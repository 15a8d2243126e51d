# Two commands do everything on a fresh machine:
#   make book   create .venv, install the pinned requirements and fa_lib, build the HTML book into _build/html
#   make test   same set-up, then every test: pytest over tests/ (reversed), nbval (strict) over every notebook in book/,
#               the book build (warnings are errors) and the headless-Chromium check of the built pages.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CI machine has no GPU: fa_lib then runs its Triton kernels under the interpreter by itself.
export PYTHONHASHSEED := 0

.PHONY: setup book serve test test-unit test-unit-reverse test-notebooks test-browser notebooks gpu-test bench clean

# The .pth line puts the repository root on the venv's path: benchmarks/ (the measurements the chapters read)
# is importable there without being part of the installed package.
$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	echo "$(CURDIR)" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fa_lib_repository.pth"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

setup: $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build . -W -n --keep-going

# Serve the built book on http://127.0.0.1:8000 (its search page needs http, not file://).
serve: book
	$(BIN)/python -m http.server 8000 --bind 127.0.0.1 --directory _build/html

# Two pytest-xdist workers: CI has 2 cores, and the interpreter-bound tests are CPU-bound. nbval keeps each
# notebook on one worker, cells in order (--dist loadscope).
XDIST := -n 2

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests -m "not browser and not gpu" $(XDIST)

# The same tests in reverse order (tests/conftest.py): no test may depend on what ran before it in its process.
# `make test` runs this order; `make test-unit` and a plain `pytest` run the files' order.
test-unit-reverse: $(STAMP)
	FA_LIB_TEST_ORDER=reverse $(BIN)/python -m pytest tests -m "not browser and not gpu" $(XDIST)

# A kernel gets ten minutes to start, not nbval's default minute: on the 2-core CI machine, with the other
# worker busy in the interpreter, a kernel once took longer than a minute to answer and every cell of its
# notebook failed at setup.
NBVAL := --nbval book --sanitize-with book/sanitize.cfg --nbval-kernel-startup-timeout 600 --ignore=_build \
	-p no:cacheprovider $(XDIST) --dist loadscope

test-notebooks: $(STAMP)
	$(BIN)/python -m pytest $(NBVAL)

# nbval once more with NumPy's SIMD code paths off: NPY_DISABLE_CPU_FEATURES lists every feature this
# NumPy dispatches and this CPU has (tools/npy_simd_features.py), so a stored output that depends on the
# SIMD path (a float16 np.exp, a float32 sum printed to its last digit) fails here.
.PHONY: test-notebooks-nosimd
test-notebooks-nosimd: $(STAMP)
	features="$$($(BIN)/python tools/npy_simd_features.py)" && echo "NPY_DISABLE_CPU_FEATURES=$$features" && \
	NPY_DISABLE_CPU_FEATURES="$$features" \
	$(BIN)/python -m pytest $(NBVAL)

test-browser: book
	$(BIN)/python -m pytest tests -m browser $(XDIST)

# The compatibility matrix (noxfile.py): fa_lib installed with a plain `pip install .` into fresh
# virtual environments, kernel and reference tests under the interpreter, against Triton 3.6.0 with
# NumPy 2.0.0 (about 75 s) and the newest Triton with the newest NumPy, which also runs
# tests/library/test_ops.py (about 160 s). (requirements.txt's own pins are what `make test-unit` runs.)
.PHONY: test-compat
test-compat: $(STAMP)
	$(BIN)/nox

test: test-unit-reverse test-notebooks test-notebooks-nosimd test-browser test-compat

# Re-execute every chapter in place (outputs are committed; nbval checks them in `make test`).
notebooks: $(STAMP)
	$(BIN)/python tools/execute_notebooks.py book/[0-9]*.ipynb

# On a CUDA machine: the same kernel tests at full size, judged by the flash-attn 2x rule.
gpu-test:
	python3 -m pytest tests/library -m gpu

# From the repository root: benchmarks/ is not part of the package.
bench:
	python3 -m benchmarks

clean:
	rm -rf _build
