# Entry points, each creating/updating the local virtual environment as needed:
#   make sweep  the main job: train the hybrid LM under 11 precision policies (~10 min on CPU)
#   make demo   the fp4lab CLI: format table and format comparison plot
#   make test   the test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: sweep demo test bench clean venv
venv: $(STAMP)

$(STAMP): pyproject.toml scripts/find-python
	@test -x $(PY) || "$$(sh scripts/find-python)" -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

sweep: $(STAMP)
	$(PY) -m experiments.sweep --out results/sweep $(ARGS)

demo: $(STAMP)
	$(VENV)/bin/fp4lab formats
	$(VENV)/bin/fp4lab compare --plot results/compare.png

test: $(STAMP)
	$(PY) -m pytest -q -n 2 $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	$(PY) benchmarks/quantize.py
	$(PY) benchmarks/train_step.py

clean:
	rm -rf $(VENV) results .pytest_cache
