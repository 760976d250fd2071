# Two entry points, each creating/updating the local virtual environment as needed:
#   make demo   the main job (the fp4lab CLI for now)
#   make test   the test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean venv
venv: $(STAMP)

$(STAMP): pyproject.toml scripts/find-python
	@test -x $(PY) || "$$(sh scripts/find-python)" -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fp4lab formats
	$(VENV)/bin/fp4lab compare --plot results/compare.png

test: $(STAMP)
	$(PY) -m pytest -q -n 2 $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	$(PY) benchmarks/quantize.py

clean:
	rm -rf $(VENV) results .pytest_cache
