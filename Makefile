# Two commands on a fresh machine, each doing its own set-up:
#   make demo   the whole diagnosis on the embedded defaults; writes a report under runs/
#   make test   every test, notebooks included, and the browser tests of the lab and the report
#               when chromium is installed (what .ci/run calls; it installs chromium first)
#   make check  the fast tier for the inner loop: every test not marked slow (no launchers,
#               Jupyter kernels, browsers or processes that import torch; pyproject.toml)
#   make lab    JupyterLab (the lab extra, installed on first use) on the notebooks, same environment
# The virtual environment is made once; installs re-run only when pyproject.toml or
# constraints.txt change (the stamp file below).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.diag-installed
BROWSER_STAMP := $(VENV)/.diag-browser-installed
ARGS   ?=

.PHONY: demo test check lab bench mutate clean-venv readme-figure

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[all]'
	@touch $@

# The browser tests' Python side (Playwright, JupyterLab): the `browser` extra, for make test.
$(BROWSER_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[browser]'
	@touch $@

demo: $(STAMP)
	$(PY) -m diag run $(ARGS)

# Tests run in as many workers as cores (pytest-xdist); TEST_WORKERS=0 runs them in one process.
# loadgroup: tests sharing one expensive fixture (an xdist_group) run on one worker, made once.
TEST_WORKERS ?= auto
test: $(BROWSER_STAMP)
	$(VENV)/bin/ruff check diag tests bench tools data
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

check: $(STAMP)
	$(VENV)/bin/ruff check diag tests bench tools data
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow" $(ARGS)

# The lab and its kernel run from this venv (jupyter_client starts the `python3` kernel with
# the lab's own interpreter), so the notebooks' kernel imports diag.
lab: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[lab]'
	$(VENV)/bin/jupyter lab notebooks/

# docs/example/: the example run README.md and docs/workshop.md quote (the demo, each notebook
# timed) and the README picture, from one run of tools/readme_figure.py
readme-figure: $(STAMP)
	$(PY) tools/readme_figure.py

# bench/qlora_*.py are bench/qlora.py's parts (qlora_regret.py also runs alone)
bench: $(STAMP)
	@for b in $(filter-out bench/qlora_%,$(wildcard bench/*.py)); do \
		echo "== $$b"; $(PY) $$b || exit 1; done

# Mutation testing (mutmut, config in pyproject.toml [tool.mutmut]): slow, so not in make test or
# CI. Of the larger modules only the decision functions are mutated; one module at a time:
# make mutate MUTANTS='diag.noise.*'. The embedded assets are made once for all mutants.
MUTANTS ?= diag.amdahl.* diag.secrets.* diag.timing.timer.* diag.machine.device.* diag.config.* \
	diag.storage.landing.x__local_ok__* diag.decision.* diag.qlora.plans.* diag.loader.advice.* \
	diag.mfu.formula.* diag.mfu.qlora.* diag.storage.checks.* \
	diag.timing.callback.* diag.noise.* diag.qlora.data.x_train_records__* \
	diag.data.tokens.x_file_identities__* diag.data.tokens.x_key_parts__* \
	diag.qlora.checkpointing.* diag.qlora.checkpoints.* diag.forecast.costs.* \
	diag.forecast.eta.x_job_counts__* diag.forecast.budget.* diag.accum.experiment.x_settle__* \
	diag.preflight.* diag.storage.sample.x_probe__*
mutate: $(STAMP)
	@test -x $(VENV)/bin/mutmut || \
	  $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[mutate]'
	mkdir -p mutants/test-home
	DIAG_TEST_HOME=$(CURDIR)/mutants/test-home \
	  $(VENV)/bin/mutmut run --max-children $$(nproc) $(foreach m,$(MUTANTS),'$(m)')
	$(PY) tools/mutation_score.py $(foreach m,$(MUTANTS),'$(m)')

clean-venv:
	rm -rf $(VENV)
