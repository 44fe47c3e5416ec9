# Two commands on a fresh machine, each doing its own set-up:
#   make demo   the whole diagnosis on the embedded defaults; writes a report under runs/
#   make test   every test, notebooks included (what .ci/run calls)
#   make lab    JupyterLab (the lab extra, installed on first use) on the notebooks, same environment
# The virtual environment is made once; installs re-run only when pyproject.toml or
# constraints.txt change (the stamp file below).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.diag-installed
ARGS   ?=

.PHONY: demo test lab bench clean-venv

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[all]'
	@touch $@

demo: $(STAMP)
	$(PY) -m diag run $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

lab: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[lab]'
	$(VENV)/bin/jupyter lab notebooks/

bench: $(STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-venv:
	rm -rf $(VENV)
