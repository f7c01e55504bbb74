# Two commands do all the set-up on a machine with only Python (3.10 or newer) and pip:
#   make train   create .venv, prepare Tiny Shakespeare, train the default model, print a sample
#   make test    create .venv and run the whole test suite (single- and multi-rank)
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
RUN := PATH="$(BIN):$$PATH"
NP ?= 1
TRAIN_ARGS ?=

.PHONY: install train test bench figures clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[mpich,dev]"
	touch $@

train: install
	$(RUN) mpiexec -n $(NP) python train_shakespeare.py $(TRAIN_ARGS)
	$(RUN) python sample.py --max-new-tokens 500

test: install
	$(RUN) python -m pytest tests

bench: install
	$(RUN) python benchmarks/benchmark.py

figures: install    # every figure of the book, from real runs here (docs/figures/)
	$(BIN)/python -m pip install --quiet -e ".[docs]"
	$(RUN) python benchmarks/figures.py

clean:
	rm -rf $(VENV) out
