# Two entry points: `make run` (a real GRPO run on the bundled tiny model) and `make test`.
# torch is installed first and pinned, so that nothing later swaps in a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e ".[dev]"
	touch $@

build/tiny/config.json: | setup
	$(BIN)/trellis tiny-model build/tiny --data build/data

run: setup build/tiny/config.json
	$(BIN)/trellis train configs/tiny_reverse.yaml

test: setup
	$(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder  # two processes, a module each at a time, in conftest's order

bench: setup
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e ".[bench]"
	$(BIN)/python bench/cpu_step.py

clean:
	rm -rf build work_dirs
