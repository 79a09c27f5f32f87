# The two commands a new user needs (see README.md):
#   make lab   install the course into .venv and open JupyterLab on labs/
#   make test  install the course into .venv and run the whole test suite
# Installing is skipped when requirements.txt and pyproject.toml have not changed.
# The test suite also needs the cluster tools (JupyterHub, SlurmSpawner, Ansible, linters) that
# cluster_setup/ pins; students never need them, so `make lab` leaves them out.

PYTHON ?= /usr/bin/python3
VENV := .venv
STAMP := $(VENV)/.installed
CLUSTER_STAMP := $(VENV)/.cluster-tools-installed
CLUSTER_REQUIREMENTS := cluster_setup/requirements-hub.txt cluster_setup/requirements-admin.txt
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: lab test install cluster-tools

install: $(STAMP)

# What cluster_setup/local needs (cluster_setup/README.md); `make test` installs it too.
cluster-tools: $(CLUSTER_STAMP)

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python >= 3.10 is needed; run make with PYTHON=/path/to/python3.11")'
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

$(CLUSTER_STAMP): $(STAMP) $(CLUSTER_REQUIREMENTS)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(addprefix -r ,$(CLUSTER_REQUIREMENTS))
	touch $@

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=labs $(ALLOW_ROOT)

test: $(CLUSTER_STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)
