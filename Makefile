# fairseq-plugins: `make demo` runs every landed method end to end; `make test` runs the test suite.
# Both install what is missing into $(VENV) first. `make install` checks the platform before it creates anything
# (scripts/check_platform.py: Linux x86_64, glibc >= 2.28, CPython 3.11 or 3.12; ALLOW_UNSUPPORTED=1 goes on
# anyway). torch is $(TORCH) unless a torch is already importable, from PyPI or from TORCH_INDEX: PyPI's Linux
# x86_64 torch is the CUDA build, so a CPU-only machine elsewhere wants
# `make install TORCH_INDEX=https://download.pytorch.org/whl/cpu` (empty by default: this project's machines reach
# PyPI only, and resolve torch==2.13.0 to a CPU wheel there). fairseq is installed without its dependencies (it
# asks for torchaudio, which would pull a CUDA torch). A GPU user: `make install TORCH='torch==2.x'` or
# `make install VENV_ARGS=--system-site-packages` to reuse an installed CUDA torch.

PYTHON    ?= python3
VENV      ?= .venv
VENV_ARGS ?=
TORCH     ?= torch==2.13.0
# An index for the torch install alone (pip --index-url), e.g. https://download.pytorch.org/whl/cpu; empty: PyPI.
TORCH_INDEX ?=
# 1: report an unsupported platform and install anyway.
ALLOW_UNSUPPORTED ?=
FAIRSEQ   ?= ve-fairseq==0.12.3
# 1: build fairseq from a source distribution (FAIRSEQ_SOURCE, compiled here: a C++ compiler, ~2 min) instead of
# installing the $(FAIRSEQ) wheel, which exists for Linux x86_64 only. The platform check then asks only for
# CPython 3.11 or 3.12 and a platform torch has wheels for (macOS arm64; Linux with glibc 2.28 or later).
FAIRSEQ_FROM_SOURCE ?=
FAIRSEQ_SOURCE ?= fairseq-fixed==0.12.3.1
# Compiler flags added to the source build's: no debug information (-g made its torch extensions compile 3x slower
# here, and nobody debugs fairseq's C++ from this build).
FAIRSEQ_SOURCE_CFLAGS ?= -g0
DATA      ?=
# make results: the groups of rows to re-measure (examples/results/remeasure.sh; empty: every group)
ROWS      ?=
PYTEST_ARGS ?=
# Test workers (pytest-xdist), one thread each: the suite's files share the cores instead of queueing on one, in
# the order tests/conftest.py collects them (longest first; xdist would order them by their number of tests).
TEST_WORKERS ?= 2
PYTEST = OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# fast_align from its source, where this checkout sits beside ../shared (CI, the project's machines): `make test`
# builds it out of tree once (the source folder is shared and stays unmodified) and points the tests at it
# through FAST_ALIGN and ATOOLS, so the subprocess backend's tests run against the real binaries. Without the
# folder or cmake nothing is built and those tests skip, saying how to build fast_align.
FAST_ALIGN_SOURCE ?= ../shared/third_party/fast_align
FAST_ALIGN_BUILD  ?= build/fast_align

BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed
FROM_SOURCE := $(filter-out 0,$(FAIRSEQ_FROM_SOURCE))
CHECK_PLATFORM = scripts/check_platform.py $(if $(filter-out 0,$(ALLOW_UNSUPPORTED)),--allow-unsupported) \
  $(if $(FROM_SOURCE),--fairseq-from-source)
# fairseq: the wheel, or (FAIRSEQ_FROM_SOURCE=1) its build requirements, then the source distribution compiled
# against the torch just installed (--no-build-isolation: an isolated build would fetch another torch).
INSTALL_FAIRSEQ = $(if $(FROM_SOURCE),$(BIN)/python -m pip install -q cython numpy setuptools wheel \
  && CFLAGS="$$CFLAGS $(FAIRSEQ_SOURCE_CFLAGS)" $(BIN)/python -m pip install -q --no-deps --no-build-isolation \
  --no-binary :all: "$(FAIRSEQ_SOURCE)",\
  $(BIN)/python -m pip install -q --no-deps "$(FAIRSEQ)")
export PATH := $(abspath $(BIN)):$(PATH)
ifneq ($(wildcard $(FAST_ALIGN_SOURCE)/CMakeLists.txt),)
ifneq ($(shell command -v cmake),)
FAST_ALIGN_BIN := $(FAST_ALIGN_BUILD)/fast_align
FAST_ALIGN_ENV := FAST_ALIGN=$(abspath $(FAST_ALIGN_BIN)) ATOOLS=$(abspath $(FAST_ALIGN_BUILD)/atools)
endif
endif

.PHONY: install test test-fast fast-align demo baseline retrain retrain-status results gpu-check gpu-dry-run clean help
help:
	@echo "make demo    install, then prepare -> train -> generate -> score -> bench every method (DATA=DIR optional)"
	@echo "make test    install, then run the test suite (TEST_WORKERS=2 processes of one thread; 0: in this one)"
	@echo "make test-fast  the tests that train no model (pytest -m 'not slow'; minutes)"
	@echo "make install check the platform, then create $(VENV) with torch ($(TORCH) unless present), $(FAIRSEQ) and"
	@echo "             this package (TORCH_INDEX=https://download.pytorch.org/whl/cpu: the CPU torch; README, Installing;"
	@echo "             FAIRSEQ_FROM_SOURCE=1: fairseq compiled from $(FAIRSEQ_SOURCE), where its wheel is missing)"
	@echo "make baseline  the full baseline recipe (examples/baseline/run.sh, ~80 min on 2 CPU cores)"
	@echo "make retrain   train the pinned model set here, two one-thread trainings at a time, resuming each (examples/results/retrain.py;"
	@echo "             in the background: mkdir -p work && setsid nohup make retrain > work/retrain.log 2>&1 &)"
	@echo "make retrain-status  each retrain job's state and its log's last line"
	@echo "make results   re-measure every README row from the pinned models (docs/results/models.json) on an idle"
	@echo "             machine; refuses while a pinned model is missing or its hash differs (examples/results/remeasure.sh;"
	@echo "             ROWS=\"baseline fast_step ...\": those groups of rows alone, needing their own models only)"
	@echo "make gpu-check STAGE=env|baseline|train|bytenet|bench|profile  one stage of the GPU kit on a CUDA machine (docs/gpu.md)"
	@echo "make gpu-dry-run  every stage of the GPU kit on the CPU, tiny data (what CI checks; a few minutes)"
	@echo "make fast-align  build fast_align from $(FAST_ALIGN_SOURCE) into $(FAST_ALIGN_BUILD) (make test does)"

install: $(STAMP)

$(STAMP): setup.py Makefile scripts/check_platform.py
	@if test -x $(BIN)/python; then $(BIN)/python $(CHECK_PLATFORM) --venv $(VENV) --python-name $(BIN)/python; \
	 elif command -v $(PYTHON) >/dev/null; then $(PYTHON) $(CHECK_PLATFORM) --python-name $(PYTHON); \
	 else echo "make install: $(PYTHON) not found; install CPython 3.11 or 3.12, then make install" \
	   "PYTHON=python3.11" >&2; exit 1; fi
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null \
	  && echo "torch already present: $$($(BIN)/python -c 'import torch; print(torch.__version__)')" \
	  || $(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH)"
	@$(BIN)/python -c "import fairseq" 2>/dev/null || { $(INSTALL_FAIRSEQ); }
	$(BIN)/python -m pip install -q -e '.[test]'
	@! $(BIN)/python -m pip show -q torchaudio 2>/dev/null || { echo "torchaudio must not be installed"; exit 1; }
	@touch $(STAMP)

test: install fast-align
	$(FAST_ALIGN_ENV) $(PYTEST) $(PYTEST_ARGS)

test-fast: install fast-align
	$(FAST_ALIGN_ENV) $(PYTEST) -m "not slow" $(PYTEST_ARGS)

ifneq ($(FAST_ALIGN_BIN),)
fast-align: $(FAST_ALIGN_BIN)

# Rebuilt only when a source file is newer than the binary: a second `make test` reuses it.
# (CMake 4 refuses fast_align's cmake_minimum_required(VERSION 2.8) without the policy minimum.)
$(FAST_ALIGN_BIN): $(wildcard $(FAST_ALIGN_SOURCE)/CMakeLists.txt $(FAST_ALIGN_SOURCE)/src/*)
	@echo "building fast_align from $(FAST_ALIGN_SOURCE) into $(FAST_ALIGN_BUILD) (log: $(FAST_ALIGN_BUILD).log)"
	@mkdir -p $(FAST_ALIGN_BUILD)
	@{ cmake -S $(FAST_ALIGN_SOURCE) -B $(FAST_ALIGN_BUILD) -DCMAKE_BUILD_TYPE=Release \
	     -DCMAKE_POLICY_VERSION_MINIMUM=3.5 && cmake --build $(FAST_ALIGN_BUILD) -j 2; } > $(FAST_ALIGN_BUILD).log 2>&1 \
	  || { tail -20 $(FAST_ALIGN_BUILD).log; echo "fast_align: the build failed (log: $(FAST_ALIGN_BUILD).log)"; exit 1; }
	@touch $@
else
fast-align:
	@echo "fast_align not built ($(if $(wildcard $(FAST_ALIGN_SOURCE)/CMakeLists.txt),cmake not found,no \
	  $(FAST_ALIGN_SOURCE))): the tests that run it will skip (tests/test_fast_align.py says how to build it)"
endif

demo: install
	DATA="$(DATA)" examples/demo/run.sh

baseline: install
	examples/baseline/run.sh $(if $(DATA),$(DATA),../shared/data/multi30k)

# The pinned model set trained on this machine (a new machine has none): docs/results/models.json's "retrain" plan,
# CORES (2) one-thread trainings at a time, each once the jobs it needs have finished and its cores are free,
# resuming where it stopped, logs in work/retrain/. Many working periods on 2 cores: start it in the background
# (mkdir -p work && setsid nohup make retrain > work/retrain.log 2>&1 &).
retrain: install
	$(BIN)/python examples/results/retrain.py $(if $(CORES),--cores $(CORES))

# (no install: the status reads files with the standard library, and must not reinstall beside the trainings)
retrain-status:
	@$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) examples/results/retrain.py --status

# Every README row again from the pinned model set; refuses to start unless every pinned model is here with its
# recorded hash, and on a loaded machine.
results: install
	DATA="$(if $(DATA),$(DATA),../shared/data/multi30k)" ROWS="$(ROWS)" examples/results/remeasure.sh

# No install step: on a lent GPU machine the kit installs the carried wheels itself (docs/gpu.md).
gpu-check:
	@test -n "$(STAGE)" || { echo "make gpu-check STAGE=env|baseline|train|bytenet|bench|profile (one per device command)"; exit 2; }
	examples/gpu/run.sh $(STAGE)

gpu-dry-run: install
	examples/gpu/dry_run.sh

clean:
	rm -rf $(VENV) *.egg-info work/demo $(FAST_ALIGN_BUILD) $(FAST_ALIGN_BUILD).log
