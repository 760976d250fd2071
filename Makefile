# Entry points, each creating/updating the local virtual environment as needed:
#   make sweep  the main job: train the hybrid LM under 11 precision policies, 3 of them
#               under 3 seeds (~15 min on 2 CPU cores)
#   make demo   the fp4lab CLI: format table and format comparison plot
#   make test   the linter (ruff, pyproject.toml's [tool.ruff]), then the test suite
# Each target installs what it needs (the sm_90 compile check's 1 GB Triton wheel only for
# `make test`).
VENV   ?= .venv
PY     := $(VENV)/bin/python
BASE   := $(VENV)/.installed-base
TEST   := $(VENV)/.installed-test
BENCH  := $(VENV)/.installed-bench
# the inference engines' own code (torch, transformers, compressed-tensors), which checks the
# exported checkpoints: a separate environment (scripts/consumer-venv says why)
CONSUMERS ?= .venv-consumers
# MaxText's own trainer with its CPU imports, where fp4lab policies run inside it
# (scripts/maxtext-venv; tests/fp4lab/test_maxtext.py)
MAXTEXT ?= .venv-maxtext

.PHONY: sweep demo test bench clean venv
venv: $(BASE)

$(PY): scripts/find-python
	@test -x $(PY) || "$$(sh scripts/find-python)" -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(BASE): pyproject.toml $(PY)
	$(PY) -m pip install --quiet -e ".[experiments,plots,export]"
	@touch $(BASE)

$(TEST): pyproject.toml $(PY)
	$(PY) -m pip install --quiet -e ".[test,compile-check]"
	@touch $(TEST) $(BASE)

$(CONSUMERS)/.installed: scripts/consumer-venv
	sh scripts/consumer-venv $(CONSUMERS)

$(MAXTEXT)/.installed: scripts/maxtext-venv
	sh scripts/maxtext-venv $(MAXTEXT)

# make check-vllm: vLLM 0.33's own configuration code (method detection, from_config, each
# layer's dispatch; no kernels, CPU torch) on tiny NVFP4 folders that fp4lab exports in both
# layouts (scripts/vllm-venv; tests/fp4lab/test_vllm_config.py, which `make test` skips
# while .venv-vllm is absent); prints what vLLM decided for each folder
VLLM ?= .venv-vllm
.PHONY: check-vllm
$(VLLM)/.installed: scripts/vllm-venv
	sh scripts/vllm-venv $(VLLM)

check-vllm: $(TEST) $(VLLM)/.installed
	FP4LAB_VLLM_PYTHON=$(abspath $(VLLM))/bin/python \
	$(PY) -m pytest -q -s -rxX tests/fp4lab/test_vllm_config.py $(PYTEST_ARGS)

$(BENCH): pyproject.toml $(PY)
	$(PY) -m pip install --quiet -e ".[bench]"
	@touch $(BENCH) $(BASE)

sweep: $(BASE)
	$(PY) -m experiments.sweep --out results/sweep $(ARGS)

demo: $(BASE)
	$(VENV)/bin/fp4lab formats
	$(VENV)/bin/fp4lab compare --plot results/compare.png

# the three environments are independent folders (pip writes its shared cache atomically):
# built side by side, llama.cpp's compile in .venv-consumers overlaps the other two's installs
# (from a fresh clone on the 2-core CI machine: 3:13 for all three)
test:
	$(MAKE) --no-print-directory --jobs=3 $(TEST) $(CONSUMERS)/.installed $(MAXTEXT)/.installed
	$(VENV)/bin/ruff check .
	FP4LAB_CONSUMER_PYTHON=$(abspath $(CONSUMERS))/bin/python \
	FP4LAB_MAXTEXT_PYTHON=$(abspath $(MAXTEXT))/bin/python \
	$(PY) -m pytest -q -n 2 --durations=25 $(PYTEST_ARGS)

bench: $(BENCH)
	$(PY) benchmarks/quantize.py
	$(PY) benchmarks/train_step.py

clean:
	rm -rf $(VENV) $(CONSUMERS) $(MAXTEXT) results .pytest_cache
